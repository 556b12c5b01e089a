"""uvicorn's HTTP/1.1 protocol (httptools) for the proxy, with one change: a request it
cannot parse gets the proxy's OpenAI-shaped JSON error, not uvicorn's plain text.

uvicorn answers such a request itself, before the app could see it (there is no
request to give it: a bad ``Content-Length``, ``Content-Length`` and
``Transfer-Encoding`` both, a broken request line), with ``text/plain`` "Invalid HTTP
request received."; an OpenAI client then fails to parse the body instead of raising
its ``BadRequestError``. The parsing, the status and the closed connection stay
uvicorn's: only the body's shape changes. Imported by ``server.serve`` only (uvicorn
is loaded there).
"""

from __future__ import annotations

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gpuctl.proxy.errors import error_body

BAD_HTTP = error_body(
    "the request is not valid HTTP/1.1, and the proxy could not read it: check its "
    "request line, its header lines, Content-Length and Transfer-Encoding (not both)",
    "invalid_request_error",
    "bad_http",
)


class ProxyHttpProtocol(HttpToolsProtocol):
    def send_400_response(self, msg: str) -> None:
        content = [b"HTTP/1.1 400 Bad Request\r\n"]
        for name, value in self.server_state.default_headers:
            content += (name, b": ", value, b"\r\n")
        content += (
            b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(BAD_HTTP),
            b"connection: close\r\n\r\n",
            BAD_HTTP,
        )
        self.transport.write(b"".join(content))
        self.transport.close()
