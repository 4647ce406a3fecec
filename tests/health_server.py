"""A minimal server for spawn tests: answers every GET with 200 on `$HEALTH_SERVER_PORT`
(`python -m tests.health_server`), as a Crucible service answers /health."""

import http.server
import os


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


if __name__ == "__main__":
    http.server.HTTPServer(("127.0.0.1", int(os.environ["HEALTH_SERVER_PORT"])), Handler).serve_forever()
