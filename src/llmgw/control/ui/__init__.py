"""The web dashboard at ``/ui/``: server-rendered pages over the admin API.

Shape: :mod:`.adminapi` calls the admin API on this control plane's own admin listener with the
admin token, so every read and every action passes the same checks as ``llmgw ctl`` (a 409 or 400
comes back with its message, shown on the page); :mod:`.auth` holds the login, the session cookie
and the CSRF token; :mod:`.pages` turns the API's views into what the templates show; :mod:`.app`
is the routes. Templates are Jinja2 with autoescaping on; the browser side is htmx (polling every
2 s, morphing the live parts in place) and uPlot, vendored in ``static/vendor`` (VENDORED.md gives
versions and checksums). No JavaScript build step.
"""
