"""The operator status page in a real browser: Debian's headless Chromium, driven by Selenium.

A real kvgate process (real Redis, the real store) fronts two stub replicas; one of them lists an older
version of ``tenant-42`` (a mismatch). The page, served on the admin listener, asks for the admin token:
a wrong one shows an error and no data; the right one shows the matrix with exactly that cell highlighted,
and the page refreshes itself when the replica catches up. The screenshot goes to the test's tmp folder,
and to ``$KVGATE_SCREENSHOT`` when set (``docs/status-page.png`` was made so: docs/operator-guide.md).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
from pathlib import Path

import aiohttp
from redis.asyncio import Redis
from selenium import webdriver
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

from gateway.adapters.publish import Published, publish_adapter, rollout_adapter
from gateway.adapters.store import AdapterStore
from gateway.core.wire import replica_id
from gateway.process.http_edge import free_port, running
from gateway.table.epoch_table import EpochTable
from gateway.table.redis_server import EmbeddedRedis
from tests.support.adapter_files import MakeAdapter
from tests.support.conditions import eventually, until_healthy
from tests.support.stub_backend import StubState, build_stub

TOKEN = "s3cret-admin-token"


def chromium() -> WebDriver:
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1500,900"):
        options.add_argument(flag)
    service = webdriver.ChromeService(executable_path=shutil.which("chromedriver") or "/usr/bin/chromedriver")
    return webdriver.Chrome(options=options, service=service)


CELLS = (
    "return [...document.querySelectorAll('td.cell')]"
    ".map(c => [c.dataset.id, c.dataset.replica, c.className])"
)


def cell_classes(driver: WebDriver) -> dict[tuple[str, str], set[str]]:
    """Every matrix cell's classes, read in one script (the page redraws itself every refresh)."""
    return {
        (logical_id, replica): set(classes.split())
        for logical_id, replica, classes in driver.execute_script(CELLS)
    }


def log_in(driver: WebDriver, token: str) -> None:
    field = driver.find_element(By.ID, "token")
    field.clear()
    field.send_keys(token)
    driver.find_element(By.ID, "connect").click()


def wrong_token_then_right(driver: WebDriver, page: str, stale: str, fresh: str, shot: Path) -> None:
    """Runs in a thread (Selenium blocks): every wait polls the DOM until it holds (WebDriverWait)."""
    wait = WebDriverWait(driver, 20, poll_frequency=0.1)
    driver.get(page)
    log_in(driver, "not-the-token")
    wait.until(lambda d: d.find_element(By.ID, "error").is_displayed())
    assert "refused" in driver.find_element(By.ID, "error").text
    assert not driver.find_element(By.ID, "data").is_displayed()
    assert cell_classes(driver) == {}, "a wrong token shows no data"
    assert driver.execute_script("return sessionStorage.getItem('kvgate-admin-token')") is None

    log_in(driver, TOKEN)
    wait.until(lambda d: ("tenant-42", stale) in cell_classes(d))
    assert not driver.find_element(By.ID, "error").is_displayed()
    assert TOKEN not in driver.current_url
    cells = cell_classes(driver)
    assert "mismatch" in cells["tenant-42", stale]
    mismatched = {key for key, classes in cells.items() if "mismatch" in classes}
    assert mismatched == {("tenant-42", stale)}, cells
    assert "current" in cells["tenant-42", fresh]
    assert "current" in cells["tenant-7", fresh]
    assert "current" in cells["tenant-7", stale]
    ratio = driver.find_element(By.CSS_SELECTOR, "tr[data-id='tenant-7'] td.ratio")
    assert (ratio.text, ratio.get_attribute("title")) == ("0.0 %", "0 of 3 prompt tokens")
    driver.save_screenshot(str(shot))


def catches_up(driver: WebDriver, stale: str) -> None:
    WebDriverWait(driver, 20, poll_frequency=0.1).until(
        lambda d: "current" in cell_classes(d).get(("tenant-42", stale), set())
    )
    assert not any("mismatch" in classes for classes in cell_classes(driver).values())


async def test_status_page_highlights_a_mismatched_replica_in_chromium(
    redis: Redis, redis_server: EmbeddedRedis, make_adapter: MakeAdapter, tmp_path: Path
) -> None:
    store = AdapterStore(tmp_path / "store")
    table = EpochTable(redis)
    old = await publish_adapter(table, store, "tenant-42", make_adapter(b"v1"), "base")
    new = await publish_adapter(table, store, "tenant-42", make_adapter(b"v2"), "base")
    other = await publish_adapter(table, store, "tenant-7", make_adapter(b"t7"), "base")

    def listing(*versions: Published) -> dict[str, str]:
        return {v.name: str(v.path) for v in versions}

    fresh_stub = StubState(adapters=listing(new, other))
    stale_stub = StubState(adapters=listing(old, other))  # still holds tenant-42's previous version
    async with running(build_stub(fresh_stub)) as fresh_url, running(build_stub(stale_stub)) as stale_url:
        port, admin_port = free_port(), free_port()
        # --workers 1: the page's traffic counters are the answering worker's (docs/workers.md)
        command = [sys.executable, "-m", "gateway.cli", "serve", "--replica", fresh_url,
                   "--replica", stale_url, "--port", str(port), "--admin-port", str(admin_port),
                   "--redis-url", redis_server.url,
                   "--store", str(store.root), "--drain-grace", "600", "--max-drain", "600",
                   "--workers", "1"]  # fmt: skip
        env = {**os.environ, "KVGATE_ADMIN_TOKEN": TOKEN}
        server = await asyncio.create_subprocess_exec(*command, env=env, stderr=asyncio.subprocess.DEVNULL)
        try:
            await until_healthy(f"http://127.0.0.1:{port}")
            admin = f"http://127.0.0.1:{admin_port}"
            async with aiohttp.ClientSession() as http:
                async with http.get(f"http://127.0.0.1:{port}/kvgate/") as public:
                    assert public.status == 404, "the page lives on the admin listener only"
                async with http.get(f"{admin}/kvgate/") as shell:
                    assert shell.status == 200
                    assert "script-src 'sha256-" in shell.headers["Content-Security-Policy"]
                    assert "tenant-42" not in await shell.text(), "the page itself holds no data"
                async with http.get(f"{admin}/kvgate/status") as status:
                    assert status.status == 401
                body = {"model": "tenant-7", "prompt": "p", "max_tokens": 1}  # usage: the cached-token ratio
                async with http.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as completion:
                    assert completion.status == 200

            driver = await asyncio.to_thread(chromium)
            try:
                shot = tmp_path / "status-page.png"
                stale, fresh = replica_id(stale_url), replica_id(fresh_url)
                await asyncio.to_thread(
                    wrong_token_then_right, driver, f"{admin}/kvgate/", stale, fresh, shot
                )
                assert shot.stat().st_size > 10_000
                if target := os.environ.get("KVGATE_SCREENSHOT"):
                    shutil.copyfile(shot, target)

                stale_stub.adapters = listing(new, other)  # the replica catches up; kvgate polls it
                await asyncio.to_thread(catches_up, driver, stale)
            finally:
                await asyncio.to_thread(driver.quit)
        finally:
            server.send_signal(signal.SIGTERM)
            await asyncio.wait_for(server.wait(), timeout=30)
    await eventually(lambda: server.returncode == 0, "kvgate stopped cleanly", 1)


def shows_the_rollout(driver: WebDriver, page: str, replica: str, shot: Path) -> None:
    wait = WebDriverWait(driver, 20, poll_frequency=0.1)
    driver.get(page)
    log_in(driver, TOKEN)
    wait.until(lambda d: ("tenant-42", replica) in cell_classes(d))
    cells = cell_classes(driver)
    assert "candidate" in cells["tenant-42", replica], "the candidate's copy is no mismatch"
    assert "mismatch" not in cells["tenant-42", replica]
    column = driver.find_element(By.CSS_SELECTOR, "tr[data-id='tenant-42'] td.rollout").text
    assert "25 %" in column, column
    assert "gate: watching" in column, column
    listed = driver.find_element(By.CSS_SELECTOR, "#rollouts li[data-id='tenant-42']").text
    assert "(candidate, epoch 2) at 25 % beside" in listed, listed
    assert "split by user" in listed, listed
    assert "candidate: " in listed, "the per-version figures"
    driver.save_screenshot(str(shot))


async def test_status_page_shows_a_running_rollout_in_chromium(
    redis: Redis, redis_server: EmbeddedRedis, make_adapter: MakeAdapter, tmp_path: Path
) -> None:
    store = AdapterStore(tmp_path / "store")
    table = EpochTable(redis)
    await publish_adapter(table, store, "tenant-42", make_adapter(b"v1"), "base")
    cand = await rollout_adapter(table, store, "tenant-42", make_adapter(b"v2"), "base", 2500)
    stub = StubState(adapters={cand.name: str(cand.path)})
    async with running(build_stub(stub)) as stub_url:
        port = free_port()
        command = [sys.executable, "-m", "gateway.cli", "serve", "--replica", stub_url, "--port", str(port),
                   "--redis-url", redis_server.url, "--store", str(store.root), "--drain-grace", "600",
                   "--rollout-gate-interval", "1"]  # fmt: skip
        env = {**os.environ, "KVGATE_ADMIN_TOKEN": TOKEN}
        server = await asyncio.create_subprocess_exec(*command, env=env, stderr=asyncio.subprocess.DEVNULL)
        try:
            await until_healthy(f"http://127.0.0.1:{port}")
            driver = await asyncio.to_thread(chromium)
            try:
                shot = tmp_path / "status-page-rollout.png"
                page = f"http://127.0.0.1:{port}/kvgate/"
                await asyncio.to_thread(shows_the_rollout, driver, page, replica_id(stub_url), shot)
                if target := os.environ.get("KVGATE_ROLLOUT_SCREENSHOT"):
                    shutil.copyfile(shot, target)
            finally:
                await asyncio.to_thread(driver.quit)
        finally:
            server.send_signal(signal.SIGTERM)
            await asyncio.wait_for(server.wait(), timeout=30)
