"""The web page in a real browser: headless Debian Chromium driven by Selenium against a real
server process. Uploads a real PNG, checks the prediction and heatmap appear (screenshot saved to
``artifacts/screenshots/``), then launches a training job from the jobs view and cancels it."""

from __future__ import annotations

import io
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.serving.procs import KEY, REPO, Server
from tests.training.conftest import make_cifar_archive

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
SCREENSHOTS = Path(os.environ.get("VIT_SERVICE_ARTIFACTS", REPO / "artifacts")) / "screenshots"

webdriver = pytest.importorskip("selenium.webdriver")
if not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()):
    if os.environ.get("VIT_SERVICE_REQUIRE_BROWSER"):  # CI: missing browser is a failure
        raise RuntimeError(f"{CHROMIUM} / {CHROMEDRIVER} missing; run `make browser`")
    pytest.skip("Debian chromium + chromium-driver not installed (make setup installs them)",
                allow_module_level=True)

from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support import expected_conditions as EC  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402


@pytest.fixture(scope="module")
def server(registry, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("web")
    data = root / "data"
    data.mkdir()
    make_cifar_archive(data / "cifar10-jpeg-train.tar.gz", per_class=30)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIT_SERVICE_", "MLFLOW_"))}
    env.update({
        "MLFLOW_TRACKING_URI": registry.uri,
        "VIT_SERVICE_HOME": str(registry.home),
        "VIT_SERVICE_DATA_DIR": str(data),
        "VIT_SERVICE_CACHE_DIR": str(root / "cache"),
        "VIT_SERVICE_MODELS": json.dumps({"cifar10-vit": "models:/cifar10-vit@champion",
                                          "imdb-sentiment": "models:/imdb-sentiment@champion"}),
        "VIT_SERVICE_API_KEY": KEY,
        "VIT_SERVICE_JOBS_POLL_S": "0.2",
        "VIT_SERVICE_MLFLOW_UI_URL": "http://127.0.0.1:5000",
        "LOG_LEVEL": "WARNING",
    })
    s = Server(env, root)
    s.start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory):
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--window-size=1200,900",
                 f"--user-data-dir={tmp_path_factory.mktemp('chrome')}"):
        opts.add_argument(flag)
    service = webdriver.ChromeService(executable_path=CHROMEDRIVER)  # never selenium-manager
    driver = webdriver.Chrome(options=opts, service=service)
    yield driver
    driver.quit()


def _wait(driver, cond, timeout: float = 60):
    return WebDriverWait(driver, timeout).until(cond)


def _first_row(driver) -> str:
    """Text of the jobs table's first row, read atomically (the table re-renders every 2 s, so
    a located element can go stale between finding and reading it)."""
    return driver.execute_script(
        "const r = document.querySelector('#jobs tbody tr'); return r ? r.innerText : '';")


def test_upload_an_image_shows_prediction_and_heatmap(server: Server, browser, tmp_path) -> None:
    rng = np.random.default_rng(0)
    img = Image.fromarray(rng.integers(0, 255, (48, 64, 3), dtype=np.uint8))
    path = tmp_path / "cat.png"
    img.save(path)
    browser.get(server.url + "/")
    _wait(browser, lambda d: "cifar10-vit" in d.find_element(By.ID, "image-model").text)
    browser.find_element(By.ID, "file").send_keys(str(path))
    preds = _wait(browser, EC.presence_of_all_elements_located((By.CSS_SELECTOR,
                                                                 "#image-preds li")))
    assert len(preds) == 5
    assert "%" in preds[0].text
    canvas = browser.find_element(By.ID, "canvas")
    _wait(browser, lambda d: canvas.get_attribute("data-rendered") == "heatmap")
    # the overlay changed pixels: the canvas is not just the uploaded image
    png = canvas.screenshot_as_png
    arr = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))
    assert arr.std() > 5
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    browser.save_screenshot(str(SCREENSHOTS / "predict.png"))  # rollout, default opacity
    views = Select(browser.find_element(By.ID, "attn-view"))
    labels = [o.text for o in views.options]
    assert labels[0] == "rollout" and any("head" in t for t in labels)
    views.select_by_index(len(labels) - 1)  # the last layer's last head
    slider = browser.find_element(By.ID, "opacity")
    browser.execute_script("arguments[0].value = 0.9; arguments[0].dispatchEvent("
                           "new Event('input'))", slider)
    assert browser.find_element(By.ID, "error").get_attribute("hidden") is not None
    assert canvas.screenshot_as_png != png  # another map, another opacity: redrawn


def test_a_corrupt_upload_shows_the_api_error(server: Server, browser, tmp_path) -> None:
    bad = tmp_path / "broken.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n this is not a png")
    browser.get(server.url + "/")
    _wait(browser, lambda d: "cifar10-vit" in d.find_element(By.ID, "image-model").text)
    browser.find_element(By.ID, "file").send_keys(str(bad))
    err = browser.find_element(By.ID, "error")
    _wait(browser, lambda d: err.get_attribute("hidden") is None and "400" in err.text)


def test_launch_and_cancel_a_job(server: Server, browser) -> None:
    browser.get(server.url + "/")
    browser.find_element(By.ID, "tab-jobs").click()
    browser.find_element(By.ID, "api-key").send_keys(KEY)
    browser.find_element(By.ID, "save-key").click()
    _wait(browser, lambda d: "cifar10-smoke" in d.find_element(By.ID, "recipe").text)
    Select(browser.find_element(By.ID, "recipe")).select_by_value("cifar10-smoke")
    browser.find_element(By.ID, "job-name").send_keys("from-the-browser")
    browser.find_element(By.ID, "overrides").send_keys("epochs=400\nmodel.pos_encoding=learned")
    browser.find_element(By.ID, "launch").click()
    _wait(browser, lambda d: "from-the-browser" in _first_row(d))
    _wait(browser, lambda d: "step" in _first_row(d), timeout=120)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    browser.save_screenshot(str(SCREENSHOTS / "jobs.png"))
    clicked = browser.execute_script(
        "const b = document.querySelector('#jobs tbody tr button.cancel');"
        "if (b) { b.click(); return true; } return false;")
    assert clicked
    _wait(browser, lambda d: "cancelled" in _first_row(d), timeout=90)
