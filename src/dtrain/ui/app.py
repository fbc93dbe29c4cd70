"""The web view as a Flask (WSGI) application: two pages and the JSON they poll.

Read-only: no route changes a job. Without a token, only requests addressed to a loopback name
are answered (a page elsewhere cannot reach it by rebinding its own DNS name to 127.0.0.1); with
one, every request must carry it (query ``token``, the cookie set from it, or ``Authorization:
Bearer``), compared in constant time, or gets 403.
"""

from __future__ import annotations

import hmac
import ipaddress

from flask import Flask, Response, abort, jsonify, redirect, render_template, request, send_file
from flask.typing import ResponseReturnValue

from dtrain.errors import DtrainError
from dtrain.jobs.store import JobRecord, JobStore
from dtrain.ui import jobview

TOKEN_COOKIE = "dtrain_ui_token"
MAX_COUNT = 2**31 - 1
"""The largest rank or attempt a request may name."""
MAX_OFFSET = 2**63 - 1
"""The largest offset into a log a request may name (a file's largest size)."""
_SECURITY_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Content-Security-Policy": (
        "default-src 'self'; img-src 'self' data:; style-src 'self' 'unsafe-inline'; "
        "frame-ancestors 'none'"
    ),
}


def is_loopback(host: str) -> bool:
    """``localhost`` or an address of the loopback range (127.0.0.0/8, ::1)."""
    name = host.strip("[]")
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _request_hostname(host: str) -> str:
    """The name in a ``Host`` header, without its port (``[::1]:80`` is ``::1``)."""
    if host.startswith("["):
        return host[1 : host.find("]")]
    return host.rpartition(":")[0] if host.count(":") == 1 else host


def _given_token() -> str:
    header = request.headers.get("Authorization", "")
    if header.startswith("Bearer "):
        return header.removeprefix("Bearer ")
    return request.args.get("token") or request.cookies.get(TOKEN_COOKIE) or ""


def create_app(store: JobStore, token: str | None = None) -> Flask:
    """The application over ``store``; ``token``, if given, is required on every request."""
    app = Flask(__name__)
    app.json.sort_keys = False  # type: ignore[attr-defined]  # on Flask's default provider

    @app.before_request
    def check_access() -> ResponseReturnValue | None:
        if token is None:
            if not is_loopback(_request_hostname(request.host)):
                abort(403, "this view answers requests to 127.0.0.1 or localhost only")
            return None
        if not hmac.compare_digest(_given_token().encode(), token.encode()):
            abort(403, "a valid token is required: open the address `dtrain ui` printed")
        if "token" in request.args and not request.path.startswith("/api/"):
            # Keep the token out of the address bar and history: a cookie carries it from here.
            response = redirect(request.path, code=303)
            response.set_cookie(TOKEN_COOKIE, token, httponly=True, samesite="Strict")
            return response
        return None

    @app.after_request
    def secure(response: Response) -> Response:
        response.headers.update(_SECURITY_HEADERS)
        response.headers.setdefault("Cache-Control", "no-store")
        return response

    def job(name: str) -> JobRecord:
        try:
            return store.get(name)
        except DtrainError as error:
            abort(404, str(error))

    @app.get("/")
    def jobs_page() -> str:
        return render_template("jobs.html")

    @app.get("/jobs/<name>")
    def job_page(name: str) -> str:
        return render_template("job.html", name=job(name).name)

    @app.get("/api/jobs")
    def jobs_api() -> Response:
        return jsonify(jobview.jobs_table(store))

    @app.get("/api/jobs/<name>")
    def job_api(name: str) -> Response:
        return jsonify(jobview.job_detail(store, job(name).name))

    @app.get("/api/jobs/<name>/metrics")
    def metrics_api(name: str) -> Response:
        series: dict[str, dict[str, list[float]]] = {}
        for sample in store.metrics(job(name).name):
            points = series.setdefault(sample.name, {"step": [], "value": [], "timestamp": []})
            points["step"].append(sample.step)
            points["value"].append(sample.value)
            points["timestamp"].append(sample.timestamp)
        return jsonify(series)

    @app.get("/api/jobs/<name>/logs")
    def logs_api(name: str) -> Response:
        record = job(name)
        rank = _int_arg("rank", 0, MAX_COUNT)
        attempt = _int_arg("attempt", 1, MAX_COUNT)
        offset = _int_arg("offset", 0, MAX_OFFSET)
        path = jobview.log_file(record, rank, attempt)
        chunk = jobview.read_log(path, offset, whole_lines=not record.is_terminal)
        return jsonify({"text": chunk.text, "offset": chunk.offset, "size": chunk.size})

    @app.get("/api/jobs/<name>/views")
    def views_api(name: str) -> Response:
        return jsonify(jobview.find_views(job(name)))

    @app.get("/api/jobs/<name>/view")
    def view_api(name: str) -> Response:
        view = jobview.read_view(job(name), request.args.get("path", ""))
        if view is None:
            abort(404, "no plan or trace JSON at that path of the job folder")
        return jsonify(view)

    @app.get("/jobs/<name>/files/<path:relative>")
    def download(name: str, relative: str) -> Response:
        path = jobview.file_in_job(job(name), relative)
        if path is None:
            abort(404, "no such file in the job folder")
        # Always a download, never rendered: a job's file must not run as this site's page.
        return send_file(path, mimetype="application/octet-stream", as_attachment=True)

    return app


def _int_arg(key: str, least: int, most: int) -> int | None:
    """The query's integer ``key``, if given: from ``least`` to ``most``, else 400 (a number
    far out of range would otherwise name a file too long to look up)."""
    value = request.args.get(key)
    if value is None or value == "":
        return None
    try:
        number = int(value)
    except ValueError:
        abort(400, f"{key} must be an integer, not {value!r}")
    if not least <= number <= most:
        abort(400, f"{key} must be from {least} to {most}, not {number}")
    return number
