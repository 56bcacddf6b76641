"""A real browser against `dagster dev` on the demo: headless Chromium (Debian's package, driven by
Playwright) sees the code location loaded with the subscription assets, the sensor and the
schedules, launches the replay job from the Launchpad and sees it succeed, and reads a stream's
status. Screenshots go to $PGSTREAM_SCREENSHOTS (default: the test's temp dir); docs/screenshots are
taken with `PGSTREAM_SCREENSHOTS=docs/screenshots`."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from playwright.sync_api import Browser, Page, sync_playwright

from pgstream_dagster.config import load_config
from pgstream_dagster.defs.assets import subscription_keys
from pgstream_dagster.engine.bootstrap import init

from .support.dagster_dev import DagsterDev, Databases, repo_root, start_dagster_dev, stop_process_group, wait_for
from .support.harness import read_jsonl

CHROMIUM = os.environ.get("PGSTREAM_CHROMIUM", "/usr/bin/chromium")
# as the machine's own probe starts it: no sandbox as root, no background network (the network is closed)
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
TIMEOUT_MS = 240_000

REPLAY_CONFIG = """ops:
  replay:
    config:
      stream_id: 1
      from_time: "{since}"
      subscription_keys: [user-signup]
"""
CONTROL_CONFIG = """ops:
  stream_control:
    config:
      stream_id: 1
      action: retry_now
"""


@contextlib.contextmanager
def _environ(env: dict[str, str]) -> Iterator[None]:
    """The demo's environment, as `make dev` sets it, for in-process calls."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def browser() -> Iterator[Browser]:
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture
def shots(tmp_path: Path) -> Path:
    out = Path(os.environ.get("PGSTREAM_SCREENSHOTS") or tmp_path / "screenshots")
    out.mkdir(parents=True, exist_ok=True)
    return out


def _body(page: Page) -> str:
    return page.inner_text("body")


def _launch(page: Page, url: str, config: str, shot: Path) -> str:
    """Open the job's Launchpad, put ``config`` in the editor, launch; returns the run page's text
    once the run succeeded."""
    page.goto(url, wait_until="networkidle")
    page.wait_for_selector(".CodeMirror")
    assert page.evaluate("(y) => { const cm = document.querySelector('.CodeMirror').CodeMirror;"
                         " cm.setValue(y); return cm.getValue(); }", config) == config
    page.wait_for_timeout(1000)  # the config is validated as typed
    page.screenshot(path=str(shot))
    page.get_by_role("button", name="Launch Run").click()
    page.wait_for_url("**/runs/**")
    page.get_by_text("RUN_SUCCESS").first.wait_for()
    return _body(page)


def test_the_ui_shows_the_demo_and_launches_a_replay(databases: Databases, tmp_path: Path, browser: Browser,
                                                     shots: Path) -> None:
    sink = tmp_path / "demo-events.jsonl"
    env = {"PGSTREAM_CONFIG": str(repo_root() / "pgstream.yaml"), "PGSTREAM_DATABASE_URL": databases.app_url,
           "PGSTREAM_DEMO_SINK": str(sink), "DAGSTER_POSTGRES_URL": databases.dagster_url,
           "DAGSTER_HOME": str(tmp_path / "dagster_home"), "PYTHONUNBUFFERED": "1"}
    with psycopg.connect(databases.app_url, autocommit=True) as conn:
        conn.execute((repo_root() / "sql" / "demo" / "demo_schema.sql").read_text())
    with _environ(env):
        print("\n".join(init(repo_root() / "pgstream.yaml")))
        demo = load_config(repo_root() / "pgstream.yaml")
    (tmp_path / "dagster_home").mkdir()
    shutil.copy(repo_root() / "dagster.yaml", tmp_path / "dagster_home" / "dagster.yaml")
    dev: DagsterDev = start_dagster_dev(tmp_path, env)
    base = f"http://127.0.0.1:{dev.port}"
    try:
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.set_default_timeout(TIMEOUT_MS)

        def loaded() -> bool:
            try:
                page.goto(f"{base}/locations", wait_until="networkidle")
                return "Loaded" in _body(page)
            except Exception:
                return False

        wait_for("the code location to show as Loaded", loaded, 180, dev)
        assert "pgstream" in _body(page)
        page.screenshot(path=str(shots / "01-code-location.png"))

        # verified sign-ups flow to the demo sink while we look around
        with psycopg.connect(databases.app_url, autocommit=True) as conn:
            conn.execute("insert into demo.users (email, email_verified) "
                         "select 'user' || g || '@example.com', true from generate_series(1, 5) g")
        wait_for("5 demo events in the sink", lambda: len(read_jsonl(sink)) >= 5, 240, dev)

        # the asset graph: subscriptions -> deliveries, the status asset
        page.goto(f"{base}/assets", wait_until="networkidle")
        page.get_by_text("deliveries").first.wait_for()
        body = _body(page)
        for expected in ("subscriptions", "deliveries", "status"):
            assert expected in body, (expected, body[:2000])
        page.screenshot(path=str(shots / "02-assets.png"))

        # automation: the sensor of the stream's reader group (default) and the housekeeping schedule
        page.goto(f"{base}/automation", wait_until="networkidle")
        page.get_by_text("pgstream_group_default").first.wait_for()
        body = _body(page)
        assert "pgstream_group_default" in body and "pgstream_housekeeping" in body, body[:2000]
        page.screenshot(path=str(shots / "03-automation.png"))

        # the stream's health: its status asset, observed by the sensor
        page.goto(f"{base}/assets/pgstream/stream_1/status", wait_until="networkidle")
        page.get_by_text("healthy").first.wait_for()
        page.screenshot(path=str(shots / "04-stream-status.png"))

        # lineage: table -> subscription -> deliveries -> status
        page.goto(f"{base}/assets/pgstream/stream_1/deliveries?view=lineage&lineageScope=upstream",
                  wait_until="networkidle")
        page.get_by_text("users").first.wait_for()
        page.wait_for_timeout(1500)
        page.screenshot(path=str(shots / "02b-lineage.png"))

        # a subscription: its definition and the trigger it generated
        signup = next(k for k in subscription_keys(demo, 1).values() if "insert" in k.path[-1])
        page.goto(f"{base}/assets/{'/'.join(signup.path)}", wait_until="networkidle")
        page.get_by_text("user-signup").first.wait_for()
        page.screenshot(path=str(shots / "07-subscription.png"))

        # replay a time range of one subscription from the Launchpad
        before = len(read_jsonl(sink))
        since = (dt.datetime.now(dt.UTC) - dt.timedelta(hours=1)).isoformat(timespec="seconds")
        run_page = _launch(page, f"{base}/locations/pgstream/jobs/pgstream_replay/playground",
                           REPLAY_CONFIG.format(since=since), shots / "05-launchpad-replay.png")
        page.screenshot(path=str(shots / "06-replay-run.png"))
        assert "replay of stream 1: 5 events" in run_page
        replayed = read_jsonl(sink)[before:]
        assert [e["id"] for e in replayed] == [e["id"] for e in read_jsonl(sink)[:5]]  # the same 5, in order

        # operator control: retry the failover checkpoint now (nothing failed here: it says so)
        control_page = _launch(page, f"{base}/locations/pgstream/jobs/pgstream_stream_control/playground",
                               CONTROL_CONFIG, shots / "08-control-retry-now.png")
        assert "stream 1 has no failed batch to retry" in control_page
        print(json.dumps({"replayed": len(replayed), "screenshots": str(shots)}))
    finally:
        survivors = stop_process_group(dev.proc)
        time.sleep(0.5)
    assert not survivors, f"processes of `dagster dev` survived: {survivors}"
