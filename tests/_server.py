"""A real uvicorn server around a `dflash-trt serve` app on 127.0.0.1 (an ephemeral port), in a background thread."""

from __future__ import annotations

import threading
import time

from dflash_trt.server.launch import listen, uvicorn_server


class RunningServer:
    def __init__(self, app, bounds=None):
        self.sock = listen("127.0.0.1", 0)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn_server(app, bounds)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> RunningServer:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(60)
