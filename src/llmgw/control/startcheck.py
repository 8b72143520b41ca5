"""What the control plane reads before it binds, each read and checked: the admin token, the
gateway's keys file, the TLS files of the agent API and the dashboard (:func:`check_config`: all of
them and server.yaml, what ``llmgw service restart server`` runs first as the service's user).
:func:`~llmgw.control.server.serve` calls the same functions, so the check and the start cannot
disagree.
"""

from __future__ import annotations

import ssl
from pathlib import Path

from llmgw import tlsconf
from llmgw.config import ServerConfig, check_token_length, load_server_config
from llmgw.control.api.agent import agent_ssl_context
from llmgw.control.gateway.keys import GatewayKeys
from llmgw.errors import PkiError


def read_admin_token(config: ServerConfig, config_path: Path) -> str:
    """The admin token (:meth:`ServerConfig.read_admin_token`), refused when shorter than
    :data:`~llmgw.config.MIN_TOKEN_CHARS` (it logs in to the dashboard too). Clients reading the
    file (``ctl``) do not check its length: the control plane's start does.

    Raises:
        ConfigError: the file is missing, unreadable or empty, or the token is too short.
    """
    return check_token_length(config.read_admin_token(config_path), config.admin_token_path(config_path))


def read_gateway_keys(config: ServerConfig) -> GatewayKeys:
    """API keys from ``gateway.keys_file`` (:mod:`llmgw.control.gateway.keys`), followed as it changes.
    No file configured: no keys (only loopback clients, when ``allow_loopback_without_key``).

    Raises:
        ConfigError: the file is configured but cannot be read, or a line is not a key.
    """
    return GatewayKeys(config.gateway.keys_file)


def agent_api_tls(config: ServerConfig) -> ssl.SSLContext:
    """The agent API's mTLS server context from ``tls.ca``/``tls.cert``/``tls.key``.

    Raises:
        PkiError: a file is missing (named) or cannot be loaded.
    """
    files = {"tls.ca": config.tls.ca, "tls.cert": config.tls.cert, "tls.key": config.tls.key}
    if gone := tlsconf.missing_files(files):
        raise PkiError(f"server.yaml: {gone}; fix the path there, or run 'llmgw server init' to create them")
    try:
        return agent_ssl_context(config)
    except (OSError, ssl.SSLError) as e:
        raise PkiError(
            f"the agent API's TLS files (tls.ca {config.tls.ca}, tls.cert {config.tls.cert}, "
            f"tls.key {config.tls.key}) cannot be loaded: {e}; run 'llmgw server init' to create them"
        ) from e


def check_config(config_path: Path) -> ServerConfig:
    """Everything :func:`serve` reads before it binds, read and checked: server.yaml, the admin
    token, the TLS files and the gateway keys file. What ``llmgw service restart server`` checks
    (as the service's user) before it stops the running control plane.

    Raises:
        ConfigError: server.yaml, the admin token or the keys file is invalid or unreadable.
        PkiError: the TLS files cannot be loaded.
    """
    config = load_server_config(config_path)
    read_admin_token(config, config_path)
    agent_api_tls(config)
    read_gateway_keys(config)
    config.ui.viewer_token(config_path)
    if config.ui.listen:
        ui_tls(config)
    return config


def ui_tls(config: ServerConfig) -> ssl.SSLContext:
    """The dashboard's TLS server context (``ui.listen``) from ``tls.cert``/``tls.key``.

    Raises:
        PkiError: the certificate or key cannot be loaded.
    """
    try:
        return tlsconf.web_server_context(config.tls.cert, config.tls.key)
    except (OSError, ssl.SSLError) as e:
        raise PkiError(
            f"ui.listen: the server certificate (tls.cert {config.tls.cert}, tls.key {config.tls.key}) cannot be "
            f"loaded: {e}; run 'llmgw server init' to create it"
        ) from e
