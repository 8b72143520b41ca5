"""Step 3: the control plane service (systemd when it is PID 1, else llmgw's supervisor), run as
the service user, and a wait until its admin API answers."""

from __future__ import annotations

from llmgw.serverinit.steps import services
from llmgw.serverinit.steps.context import InitContext
from llmgw.service.units import server_unit


def run(ctx: InitContext) -> None:
    """Install and start ``llmgw-server``; wait for its admin API to answer.

    Raises:
        ServiceError: it failed to start. WaitTimeout: it did not answer within ``--service-wait``.
    """
    user = services.service_user(ctx)
    services.apply_service(ctx, "server", server_unit(ctx.paths, ctx.bin, user=user), "control plane")
    client = ctx.admin()
    services.wait_service(ctx, "server", "the control plane", client.health)
