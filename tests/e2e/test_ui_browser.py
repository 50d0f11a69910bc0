"""The jobs view in a real headless Chromium against a real ``airflow api-server``.

The api-server (PostgreSQL metadata, tests/fixtures/airflow_deployment.start_api_server) loads
the provider's plugin and reads a real SQLite manifest store, in which a job is planned and run by
real worker subprocesses: first half-way (one shard committed, one leased, then preempted), then
to its published manifest. Users log in through Airflow's own ``POST /auth/token``; the browser
carries the JWT in the UI's ``_token`` cookie, as after a login. ``outsider`` may not read the
job's DAG (tests/fixtures/ui_auth_manager.py). Screenshots go to ``$ADB_TEST_ARTEFACTS`` (or the
test's tmp dir).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("selenium")
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.chrome.webdriver import WebDriver
from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions as ec
from selenium.webdriver.support.ui import WebDriverWait

from airflow_deadline_batch.core.states import AttemptOutcome
from airflow_deadline_batch.service.finalize import finalize_job
from airflow_deadline_batch.store import ManifestStore
from airflow_deadline_batch.ui.render import fmt_time
from tests.fixtures.airflow_deployment import (
    AirflowDeployment,
    login_token,
    metadata_database,
    start_api_server,
    stop_deployment,
)
from tests.fixtures.postgres import PgServer
from tests.helpers.sample_job import plan_sample_job

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1280,1600",
)
DAG_ID, RUN_ID = "ui_batch", "manual__2026-11-30T00:00:00+00:00"
OTHER_DAG_ID = "ui_other"
PASSWORDS = {"viewer": "viewer-pw", "outsider": "outsider-pw"}
#: a page or element shows up within this (two loaded cores, a cold browser)
WAIT_S = 60

if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
    pytest.skip("needs Debian's chromium and chromium-driver", allow_module_level=True)


@dataclass(frozen=True)
class UI:
    airflow: AirflowDeployment
    store_url: str
    output: Path

    @property
    def base(self) -> str:
        return self.airflow.base_url

    def token(self, user: str) -> str:
        return login_token(self.base, user, PASSWORDS[user])


@pytest.fixture(scope="module")
def ui(pg_server: PgServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[UI]:
    home = tmp_path_factory.mktemp("airflow-ui")
    store_url = f"sqlite:///{home / 'store.db'}"
    ManifestStore.open(store_url).close()  # the tables exist before the api-server reads them
    passwords = home / "passwords.json"
    passwords.write_text(json.dumps(PASSWORDS))
    dags = home / "dags"
    dags.mkdir()
    env = {
        "AIRFLOW__CORE__AUTH_MANAGER": "tests.fixtures.ui_auth_manager.DagDenyingAuthManager",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "False",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "viewer:viewer,outsider:viewer",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(passwords),
        "ADB_TEST_DENIED_DAGS": f"outsider:{DAG_ID}",
        "ADB_STORE_URL": store_url,
    }
    with metadata_database(pg_server) as db_url:
        deployment = start_api_server(home, db_url=db_url, dags_folder=dags, extra_env=env)
        try:
            yield UI(deployment, store_url, home / "out")
        finally:
            stop_deployment(deployment)


@pytest.fixture()
def artefacts(tmp_path: Path) -> Path:
    folder = Path(os.environ.get("ADB_TEST_ARTEFACTS") or tmp_path) / "ui"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture()
def browser(tmp_path: Path) -> Iterator[WebDriver]:
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path / 'chromium-profile'}")
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    driver.set_page_load_timeout(WAIT_S)
    try:
        yield driver
    finally:
        driver.quit()


# -- helpers -------------------------------------------------------------------------------------


def status_of(url: str, token: str | None = None) -> int:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def get_json(url: str, token: str) -> Any:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def log_in(driver: WebDriver, ui: UI, user: str) -> None:
    """Put the user's JWT in the UI's cookie, as Airflow's login page does."""
    driver.get(f"{ui.base}/api/v2/version")
    driver.delete_all_cookies()
    driver.add_cookie({"name": "_token", "value": ui.token(user), "path": "/"})


def open_page(driver: WebDriver, url: str, css: str) -> Any:
    driver.get(url)
    return WebDriverWait(driver, WAIT_S).until(ec.presence_of_element_located((By.CSS_SELECTOR, css)))


def text(driver: WebDriver, css: str) -> str:
    return str(driver.find_element(By.CSS_SELECTOR, css).text).strip()


def run_worker(store_url: str, job_id: str, shard: int, tmp_path: Path) -> None:
    log = tmp_path / f"worker-{shard}.log"
    with log.open("wb") as out:
        code = subprocess.run(
            [sys.executable, "-m", "airflow_deadline_batch.worker", "--job", job_id, "--shard", str(shard)]
            + ["--pool", "local-spot"],
            env={**os.environ, "ADB_STORE_URL": store_url},
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            timeout=300,
        ).returncode
    assert code == 0, log.read_text()[-3000:]


def plan(store: ManifestStore, output: Path, key: str) -> str:
    return plan_sample_job(store, key, output, deadline_in=dt.timedelta(minutes=20))


def assert_page_matches_store(driver: WebDriver, store: ManifestStore, job_id: str) -> None:
    """The numbers on the page are the store's (read after the page, nothing commits in between)."""
    progress = store.progress(job_id)
    job = store.get_job(job_id)
    assert text(driver, "#job-id") == job_id
    assert text(driver, "#state") == progress.state.value
    assert text(driver, "#records") == f"{progress.committed_records} / {progress.total_records}"
    assert text(driver, "#deadline") == fmt_time(job.deadline)
    assert text(driver, "#preemptions") == str(progress.preemptions)
    assert text(driver, "#errored-records") == str(progress.errored)
    rows = driver.find_elements(By.CSS_SELECTOR, "#shards-by-state tr")[1:]
    by_state: dict[str, int] = {}
    for row in rows:
        state, _pool, count = (c.text for c in row.find_elements(By.TAG_NAME, "td"))
        by_state[state] = by_state.get(state, 0) + int(count)
    assert by_state == dict(progress.shards_by_state)
    attempts = [int(c.text) for c in driver.find_elements(By.CSS_SELECTOR, "#shards tr td:nth-child(5)")]
    assert sum(attempts) == progress.attempts


def assert_chart(driver: WebDriver) -> None:
    svg = driver.find_element(By.CSS_SELECTOR, "svg#burndown-chart")
    assert svg.is_displayed()
    burn = driver.find_element(By.CSS_SELECTOR, "svg#burndown-chart path#burndown")
    assert burn.get_attribute("d").startswith("M")
    assert driver.find_element(By.CSS_SELECTOR, "svg#burndown-chart path#uniform")
    assert driver.find_element(By.CSS_SELECTOR, "svg#slack-chart path#slack")


# -- the test ------------------------------------------------------------------------------------


def test_jobs_view_in_a_real_browser_mid_run_and_after_publication(
    ui: UI, browser: WebDriver, artefacts: Path, tmp_path: Path
) -> None:
    store = ManifestStore.open(ui.store_url)
    job_id = plan(store, ui.output, f"{DAG_ID}/{RUN_ID}/plan")
    other_id = plan(store, ui.output, f"{OTHER_DAG_ID}/{RUN_ID}/plan")
    shards = store.list_shards(job_id)
    assert len(shards) == 2, "the sample input plans into two shards at this size"
    run_worker(ui.store_url, job_id, 0, tmp_path)
    lease = store.claim_shard(job_id, 1, ttl_s=600, worker="ui-test", pool="local-spot")
    page_url = f"{ui.base}/deadline-batch/jobs/{job_id}"

    # anonymous: refused by Airflow's own authentication, in the browser and over plain HTTP
    assert status_of(page_url) == 401
    assert status_of(f"{ui.base}/deadline-batch/api/jobs") == 401
    browser.get(page_url)
    assert "Not authenticated" in browser.page_source
    assert "burndown" not in browser.page_source

    # a user who may not read the job's DAG: 403, and the job is not in their list
    outsider = ui.token("outsider")
    assert status_of(page_url, outsider) == 403
    assert status_of(f"{ui.base}/deadline-batch/api/jobs/{job_id}", outsider) == 403
    listed = {j["job_id"] for j in get_json(f"{ui.base}/deadline-batch/api/jobs", outsider)}
    assert listed == {other_id}
    log_in(browser, ui, "outsider")
    browser.get(page_url)
    assert "Forbidden" in browser.page_source and job_id not in text(browser, "body")

    # mid-run, as a viewer of the DAG: the page reloads itself, the chart renders, numbers match
    log_in(browser, ui, "viewer")
    open_page(browser, page_url, "svg#burndown-chart")
    assert browser.find_elements(By.CSS_SELECTOR, "meta[http-equiv='refresh']")
    assert_chart(browser)
    assert_page_matches_store(browser, store, job_id)
    assert text(browser, "#manifest") == "not published yet"
    assert text(browser, "#planned-by") == f"{DAG_ID} / {RUN_ID}"
    browser.save_screenshot(str(artefacts / "job-mid-run.png"))

    # the DAG run / task instance tab: the UI fills in the URL-encoded DAG and run IDs
    run_tab = f"{ui.base}/deadline-batch/runs/{DAG_ID}/{urllib.parse.quote(RUN_ID, safe='')}"
    assert status_of(run_tab, outsider) == 403
    open_page(browser, run_tab, "#job-id")
    assert text(browser, "#job-id") == job_id

    open_page(browser, f"{ui.base}/deadline-batch/jobs", "table#jobs")
    assert job_id in text(browser, "#jobs") and other_id in text(browser, "#jobs")
    browser.save_screenshot(str(artefacts / "jobs.png"))

    # Airflow's UI lists the view in its navigation and embeds the page
    plugins = get_json(f"{ui.base}/api/v2/plugins", ui.token("viewer"))
    views = {
        v["url_route"]: v
        for p in plugins["plugins"]
        for v in p["external_views"]
        if p["name"] == "deadline_batch"
    }
    assert {k: v["destination"] for k, v in views.items()} == {
        "deadline-batch": "nav",
        "deadline-batch-run": "dag_run",
        "deadline-batch-task": "task_instance",
    }
    open_page(browser, f"{ui.base}/plugin/deadline-batch", "iframe")
    wait = WebDriverWait(browser, WAIT_S)
    wait.until(ec.frame_to_be_available_and_switch_to_it((By.CSS_SELECTOR, "iframe")))
    wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, "table#jobs")))
    assert job_id in text(browser, "#jobs")
    browser.switch_to.default_content()
    browser.save_screenshot(str(artefacts / "airflow-nav.png"))

    # the Spot try on shard 1 is preempted, a new worker finishes it, the manifest is published
    assert store.release(lease, AttemptOutcome.PREEMPTED)
    run_worker(ui.store_url, job_id, 1, tmp_path)
    result = finalize_job(store, job_id)
    assert result.manifest_uri

    open_page(browser, page_url, "a#manifest")
    assert not browser.find_elements(By.CSS_SELECTOR, "meta[http-equiv='refresh']")
    assert_chart(browser)
    assert_page_matches_store(browser, store, job_id)
    assert text(browser, "#manifest") == result.manifest_uri
    assert text(browser, "#preemptions") == "1"
    browser.save_screenshot(str(artefacts / "job-published.png"))
    manifest = get_json(f"{ui.base}/deadline-batch/api/jobs/{job_id}/manifest", ui.token("viewer"))
    assert manifest["job_id"] == job_id
    # every line's published outcome, as the manifest counts it
    shown = dict(item.rsplit(" ", 1) for item in text(browser, "#outcomes").split(", "))
    assert {k: int(v) for k, v in shown.items()} == manifest["outcomes"]
    assert status_of(f"{ui.base}/deadline-batch/api/jobs/{job_id}/manifest", outsider) == 403
    store.close()
