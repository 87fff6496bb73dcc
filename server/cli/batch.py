"""``inferplane batch submit|status|list|cancel|download``: batch jobs over a running frontend's
``/v1/files`` and ``/v1/batches`` (the OpenAI batch API; standard library HTTP only)."""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Annotated, Optional

import typer

batch_app = typer.Typer(help="Batch jobs: a JSONL file of requests run at low priority, each row exactly once.", no_args_is_help=True)

Url = Annotated[Optional[str], typer.Option("--url", help="The frontend's REST bridge [default: http://HOST:HTTP_PORT from the settings].")]
ApiKey = Annotated[Optional[str], typer.Option("--api-key", help="API key (with --auth on) [env INFERPLANE_API_KEY].")]
AsJson = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]
TERMINAL = ("completed", "failed", "expired", "cancelled")


class _Api:
    def __init__(self, url: str | None, api_key: str | None):
        from server.settings import Settings

        settings = Settings()
        self.base = (url or f"http://{settings.host}:{settings.http_port}").rstrip("/")
        self.key = api_key or settings.api_key.get_secret_value()

    def call(self, method: str, path: str, body: bytes | None = None, content_type: str = "application/json") -> bytes:
        headers = {"Content-Type": content_type} if body is not None else {}
        if self.key:
            headers["Authorization"] = f"Bearer {self.key}"
        request = urllib.request.Request(self.base + path, data=body, headers=headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.read()
        except urllib.error.HTTPError as err:
            try:
                e = json.loads(err.read())["error"]
                detail = f"{e.get('code')}: {e.get('message')}"
            except Exception:  # noqa: BLE001 - not our JSON error: say the status
                detail = err.reason
            _fail(f"{method} {path}: HTTP {err.code} {detail}")
        except urllib.error.URLError as err:
            _fail(f"cannot reach {self.base}: {err.reason}")

    def json(self, method: str, path: str, doc: dict | None = None) -> dict:
        return json.loads(self.call(method, path, None if doc is None else json.dumps(doc).encode()))

    def upload(self, path: Path) -> dict:
        boundary = uuid.uuid4().hex
        body = (
            f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{path.name}"\r\n'
            "Content-Type: application/jsonl\r\n\r\n"
        ).encode() + path.read_bytes() + f"\r\n--{boundary}--\r\n".encode()
        return json.loads(self.call("POST", "/v1/files", body, f"multipart/form-data; boundary={boundary}"))


def _fail(message: str) -> None:
    typer.secho(f"error: {message}", err=True, fg="red")
    raise typer.Exit(1)


def _line(b: dict) -> str:
    c = b["request_counts"]
    return f"{b['id']}  {b['status']:<11} {c['completed']}/{c['total']} done, {c['failed']} failed  {b['endpoint']}"


def progress(done: int, total: int, elapsed_s: float, width: int = 30) -> str:
    """``[#####.....] 120/400 rows  35.2 rows/s  ETA 8s``: the bar the wait loop redraws."""
    fraction = done / total if total else 1.0
    filled = int(round(fraction * width))
    rate = done / elapsed_s if elapsed_s > 0 else 0.0
    eta = f"{(total - done) / rate:.0f}s" if rate > 0 and done < total else ("0s" if done >= total else "?")
    return f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total} rows  {rate:.1f} rows/s  ETA {eta}"


def _wait(api: _Api, batch_id: str, poll_s: float) -> dict:
    started = time.monotonic()
    first, shown, tty = None, None, sys.stderr.isatty()
    while True:
        b = api.json("GET", f"/v1/batches/{batch_id}")
        c = b["request_counts"]
        done = c["completed"] + c["failed"]
        first = done if first is None else first  # rows done before this wait began do not count in the rate
        bar = progress(done - first, c["total"] - first, time.monotonic() - started)
        if tty:  # redrawn in place; a pipe or log gets a line each time the count moves
            print("\r" + bar, end="", file=sys.stderr, flush=True)
        elif done != shown:
            print(bar, file=sys.stderr, flush=True)
        shown = done
        if b["status"] in TERMINAL:
            if tty:
                print(file=sys.stderr)
            return b
        time.sleep(poll_s)


@batch_app.command("submit")
def submit(
    file: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="JSONL: one {custom_id, method, url, body} per line.")],
    endpoint: Annotated[str, typer.Option("--endpoint", help="/v1/chat/completions, /v1/completions, /v1/embeddings or /v2/models/NAME/infer.")],
    window: Annotated[str, typer.Option("--window", help="completion_window: a job not done by then ends expired.")] = "24h",
    metadata: Annotated[Optional[list[str]], typer.Option("--metadata", help="KEY=VALUE (repeatable).")] = None,
    wait: Annotated[bool, typer.Option("--wait", help="Show progress (rows done, rows/s, ETA) until the job ends.")] = False,
    poll_s: Annotated[float, typer.Option("--poll-s", help="How often --wait asks.")] = 1.0,
    url: Url = None,
    api_key: ApiKey = None,
    as_json: AsJson = False,
) -> None:
    """Upload FILE and start a batch job over it; print its id (with --wait: its end state; exit 1 unless completed)."""
    pairs = {}
    for item in metadata or []:
        key, sep, value = item.partition("=")
        if not sep:
            _fail(f"--metadata {item!r} is not KEY=VALUE")
        pairs[key] = value
    api = _Api(url, api_key)
    uploaded = api.upload(file)
    b = api.json("POST", "/v1/batches", {"input_file_id": uploaded["id"], "endpoint": endpoint, "completion_window": window, "metadata": pairs or None})
    if wait:
        b = _wait(api, b["id"], poll_s)
    typer.echo(json.dumps(b) if as_json else _line(b))
    if wait and b["status"] != "completed":
        raise typer.Exit(1)


@batch_app.command("status")
def status(batch_id: str, url: Url = None, api_key: ApiKey = None, as_json: AsJson = False) -> None:
    """One job: status, rows done and failed, its files."""
    b = _Api(url, api_key).json("GET", f"/v1/batches/{batch_id}")
    if as_json:
        typer.echo(json.dumps(b))
        return
    typer.echo(_line(b))
    for key in ("input_file_id", "output_file_id", "error_file_id"):
        if b.get(key):
            typer.echo(f"  {key.removesuffix('_id')}: {b[key]}")


@batch_app.command("list")
def list_jobs(limit: Annotated[int, typer.Option(help="At most this many, newest first.")] = 20, url: Url = None, api_key: ApiKey = None, as_json: AsJson = False) -> None:
    """The caller's jobs, newest first."""
    page = _Api(url, api_key).json("GET", f"/v1/batches?limit={limit}")
    if as_json:
        typer.echo(json.dumps(page["data"]))
        return
    for b in page["data"]:
        typer.echo(_line(b))


@batch_app.command("cancel")
def cancel(batch_id: str, url: Url = None, api_key: ApiKey = None) -> None:
    """Cancel a job: it stops within one row batch; completed rows stay in its output."""
    typer.echo(_line(_Api(url, api_key).json("POST", f"/v1/batches/{batch_id}/cancel")))


@batch_app.command("download")
def download(
    batch_id: str,
    out: Annotated[Optional[Path], typer.Option("--out", help="Write here [default: print].")] = None,
    errors: Annotated[bool, typer.Option("--errors", help="The error file (failed, expired, cancelled rows) instead of the output.")] = False,
    url: Url = None,
    api_key: ApiKey = None,
) -> None:
    """A job's output (or error) JSONL: one line per row, in input order."""
    api = _Api(url, api_key)
    b = api.json("GET", f"/v1/batches/{batch_id}")
    file_id = b["error_file_id" if errors else "output_file_id"]
    if not file_id:
        _fail(f"batch {batch_id} ({b['status']}) has no {'error' if errors else 'output'} file")
    data = api.call("GET", f"/v1/files/{file_id}/content")
    if out is None:
        sys.stdout.buffer.write(data)
    else:
        out.write_bytes(data)
        typer.echo(f"{len(data.splitlines())} rows -> {out}")


def mount(app: typer.Typer) -> None:
    app.add_typer(batch_app, name="batch")
