"""Drive a real headless Chromium (Debian's `chromium` package) over the DevTools protocol:
navigate, evaluate JavaScript, take screenshots. Real time passes between calls, so a page
that polls a live server behaves as it does for a user (unlike --dump-dom's virtual time)."""
from __future__ import annotations

import base64
import itertools
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

BINARIES = ("chromium", "chromium-browser", "google-chrome")


def find_chromium() -> str | None:
    return next((path for name in BINARIES if (path := shutil.which(name))), None)


class HeadlessChromium:
    def __init__(self, binary: str, width: int = 1400, height: int = 1000, timeout_s: float = 30.0) -> None:
        import websocket   # websocket-client, a test dependency

        self._profile = tempfile.mkdtemp(prefix="tokenmill-chromium-")
        self.proc = subprocess.Popen(
            [binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--disable-dev-shm-usage", "--remote-debugging-port=0", "--remote-allow-origins=*",
             f"--user-data-dir={self._profile}", f"--window-size={width},{height}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port = self._devtools_port(timeout_s)
        page = next(t for t in httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json()
                    if t["type"] == "page")
        self._ws = websocket.create_connection(page["webSocketDebuggerUrl"], timeout=timeout_s,
                                               suppress_origin=True)
        self._ids = itertools.count(1)
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1,
                  mobile=False)

    def _devtools_port(self, timeout_s: float) -> int:
        marker = Path(self._profile) / "DevToolsActivePort"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"chromium exited with {self.proc.returncode}")
            if marker.exists() and (lines := marker.read_text().split()):
                return int(lines[0])
            time.sleep(0.1)
        raise TimeoutError("chromium did not open its DevTools port")

    def call(self, method: str, **params: Any) -> dict:
        msg_id = next(self._ids)
        self._ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        while True:      # skip events until our answer arrives
            msg = json.loads(self._ws.recv())
            if msg.get("id") == msg_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression!r} threw: {result['exceptionDetails']}")
        return result["result"].get("value")

    def navigate(self, url: str, timeout_s: float = 30.0) -> None:
        self.call("Page.navigate", url=url)
        deadline = time.monotonic() + timeout_s
        while self.evaluate("document.readyState") != "complete" or self.evaluate("location.href") != url:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} did not load")
            time.sleep(0.1)

    def screenshot(self, path: Path) -> None:
        data = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"]
        path.write_bytes(base64.b64decode(data))

    def close(self) -> None:
        try:
            self._ws.close()
        finally:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            shutil.rmtree(self._profile, ignore_errors=True)
