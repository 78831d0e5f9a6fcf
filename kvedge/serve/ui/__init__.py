"""The chat page `kvedge serve` answers at `GET /` when the `ui` setting is on (config.py).

Files (this folder, shipped as package data; no build step, nothing fetched from elsewhere)::

    index.html   the page: conversation, composer, settings (system prompt, persona = a warm
                 prefix, sampling, reply format, tools, persistence), API-key form
    chat.js      talks to this server's own OpenAI API: POST /v1/chat/completions streamed
                 (fetch + ReadableStream, Stop = AbortController), GET /v1/models for the model
                 id and its `warm_prefixes`
    chat.css     light and dark (prefers-color-scheme), 7" screens to laptops
    icon.svg     the tab icon (served here so the browser asks nothing of another origin)

Model output is untrusted: chat.js puts it in the page with `textContent` only. The page and its
files are static and public (a browser cannot send a bearer key when it navigates); the API calls
they make carry the key the page asks for, kept in the tab's sessionStorage. Every response here
carries `HEADERS`: a Content-Security-Policy that allows scripts, styles, images and connections
from this origin only (no inline script or style, no frames, no form posts), `nosniff` and a
frame refusal.
"""

from __future__ import annotations

import ipaddress
from importlib import resources

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

# file name -> media type; only these are served (no path from the request reaches the disk)
FILES = {
    "index.html": "text/html; charset=utf-8",
    "chat.js": "text/javascript; charset=utf-8",
    "chat.css": "text/css; charset=utf-8",
    "icon.svg": "image/svg+xml",
}
CSP = "; ".join(
    (
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self'",
        "connect-src 'self'",
        "object-src 'none'",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    )
)
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # revalidate, so an upgraded kvedge's page is the one shown
}


def routes() -> list[Route]:
    """`GET /` (the page) and `GET /ui/<file>` for each of `FILES`, read once here."""
    folder = resources.files(__name__)
    bodies = {name: (folder / name).read_bytes() for name in FILES}

    def serve(name: str):
        async def handler(request: Request) -> Response:
            return Response(bodies[name], media_type=FILES[name], headers=HEADERS)

        return handler

    return [Route("/", serve("index.html"), methods=["GET"])] + [
        Route(f"/ui/{name}", serve(name), methods=["GET"]) for name in FILES
    ]


def page_url(host: str, port: int) -> str:
    """Where a browser finds the page: `host` as written, an IPv6 address in brackets, and for a
    wildcard bind (0.0.0.0, ::) a placeholder, since any of the device's addresses answers."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return f"http://{host}:{port}/"
    if address.is_unspecified:
        return f"http://<this device's address>:{port}/"
    return f"http://[{host}]:{port}/" if address.version == 6 else f"http://{host}:{port}/"
