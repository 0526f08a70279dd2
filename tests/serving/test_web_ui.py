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
    # a user's own model: registered with @champion, served by discovery beside the two above
    registry.register_copy("my-pets", champion=True, tmp_path=root)
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
    assert labels[1].startswith("relevance")
    faith = browser.find_element(By.ID, "faith")
    assert faith.get_attribute("data-map") == "rollout" and "deletion AUC" in faith.text
    views.select_by_value("relevance")
    _wait(browser, lambda d: faith.get_attribute("data-map") == "relevance")
    assert "relevance: deletion AUC" in faith.text and "random" in faith.text
    assert faith.find_elements(By.CSS_SELECTOR, "path.curve")  # the map's curve is drawn
    browser.execute_script("arguments[0].scrollIntoView({block: 'end'})", faith)
    browser.save_screenshot(str(SCREENSHOTS / "relevance.png"))  # relevance + deletion curve
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


def _chart_points(driver, chart: str) -> int:
    return int(driver.execute_script(
        f"const e = document.getElementById('{chart}'); return e ? (e.dataset.points || 0) : 0;"))


def _launch(driver, recipe: str, name: str, overrides: str, budget: str = "") -> None:
    for field, value in (("job-name", name), ("overrides", overrides), ("budget", budget)):
        el = driver.find_element(By.ID, field)
        el.clear()
        el.send_keys(value)
    # set by script: the recipe options are re-rendered whenever the recipes are (re)loaded,
    # which can make a located <option> stale
    driver.execute_script("document.getElementById('recipe').value = arguments[0];", recipe)
    assert driver.find_element(By.ID, "recipe").get_attribute("value") == recipe
    driver.find_element(By.ID, "launch").click()
    _wait(driver, lambda d: name in _first_row(d))


def test_live_curves_and_a_comparison_plot(server: Server, browser) -> None:
    browser.get(server.url + "/")
    browser.find_element(By.ID, "tab-jobs").click()
    key = browser.find_element(By.ID, "api-key")
    key.clear()
    key.send_keys(KEY)
    browser.find_element(By.ID, "save-key").click()
    _wait(browser, lambda d: "cifar10-smoke" in d.find_element(By.ID, "recipe").text)
    # untick whatever earlier tests plotted
    browser.execute_script("localStorage.setItem('vitPicked', '[]'); state.picked.clear();")
    _launch(browser, "cifar10-smoke", "curve-a", "epochs=150")
    _wait(browser, lambda d: "running" in _first_row(d), timeout=120)
    _wait(browser, lambda d: _chart_points(d, "chart-loss") >= 2, timeout=120)
    first = _chart_points(browser, "chart-loss")
    _wait(browser, lambda d: _chart_points(d, "chart-loss") > first, timeout=120)  # it grows
    assert "ETA" in _first_row(browser) or "succeeded" in _first_row(browser)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    browser.execute_script("document.getElementById('charts').scrollIntoView({block: 'end'})")
    browser.save_screenshot(str(SCREENSHOTS / "jobs-live-curves.png"))
    _wait(browser, lambda d: "succeeded" in _first_row(d), timeout=300)
    _wait(browser, lambda d: _chart_points(d, "chart-val") >= 1)  # the final validation point

    _launch(browser, "cifar10-smoke", "curve-b", "epochs=3\noptim.lr=0.001")
    _wait(browser, lambda d: "succeeded" in _first_row(d), timeout=300)
    _wait(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#chart-val path.series")) == 2)
    legend = browser.find_element(By.ID, "chart-legend").text
    assert "curve-a" in legend and "curve-b" in legend
    assert "epochs=150" in legend and "optim.lr=0.001" in legend and "val " in legend
    browser.execute_script("document.getElementById('charts').scrollIntoView({block: 'end'})")
    browser.save_screenshot(str(SCREENSHOTS / "jobs-compare.png"))


def test_model_card_shows_mlflow_accuracy(server: Server, browser) -> None:
    browser.get(server.url + "/")
    card = browser.find_element(By.ID, "image-card")
    _wait(browser, lambda d: card.get_attribute("hidden") is None)
    assert "cifar10-vit" in card.text and "v1 @champion" in card.text
    assert card.find_element(By.CSS_SELECTOR, ".val-acc").text == "50.0 %"  # MLflow's val_acc
    assert len(card.find_elements(By.CSS_SELECTOR, "table.confusion tr")) == 10
    assert "cat" in card.text and "83.3 %" in card.text  # per-class recall
    assert browser.find_element(By.ID, "image-empty").get_attribute("hidden") is not None
    browser.save_screenshot(str(SCREENSHOTS / "model-card.png"))


def test_the_model_picker_offers_registered_champions(server: Server, browser, tmp_path
                                                      ) -> None:
    path = tmp_path / "pet.png"
    Image.fromarray(np.full((40, 48, 3), 120, dtype=np.uint8)).save(path)
    browser.get(server.url + "/")
    picker = Select(_wait(browser, EC.presence_of_element_located((By.ID, "image-model"))))
    _wait(browser, lambda d: "my-pets" in d.find_element(By.ID, "image-model").text)
    names = [o.get_attribute("value") for o in picker.options]
    assert {"cifar10-vit", "my-pets"} <= set(names) and "imdb-sentiment" not in names
    picker.select_by_value("my-pets")
    card = browser.find_element(By.ID, "image-card")
    _wait(browser, lambda d: "my-pets" in card.text and "my-pets-0" in card.text)
    browser.find_element(By.ID, "file").send_keys(str(path))
    _wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#image-preds li"))
    preds = browser.find_elements(By.CSS_SELECTOR, "#image-preds li")
    assert preds and all("my-pets-" in p.text for p in preds)
    assert "my-pets" in browser.find_element(By.ID, "image-model-info").text
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    browser.save_screenshot(str(SCREENSHOTS / "model-picker.png"))


def test_empty_states_for_a_newcomer(registry, browser, tmp_path_factory) -> None:
    root = tmp_path_factory.mktemp("web-empty")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIT_SERVICE_", "MLFLOW_"))}
    env.update({
        "MLFLOW_TRACKING_URI": registry.uri, "VIT_SERVICE_HOME": str(root),
        "VIT_SERVICE_MODELS": json.dumps({"cifar10-vit": "models:/not-trained-yet@champion",
                                          "imdb-sentiment": "models:/nor-this@champion"}),
        # the shared registry holds champions; a newcomer's does not
        "VIT_SERVICE_DISCOVER_MODELS": "0", "LOG_LEVEL": "WARNING",
    })
    s = Server(env, root)
    s.start()
    try:
        browser.get(s.url + "/")
        empty = browser.find_element(By.ID, "image-empty")
        _wait(browser, lambda d: empty.get_attribute("hidden") is None)
        assert "No image model is served yet" in empty.text
        assert browser.find_element(By.ID, "image-card").get_attribute("hidden") is not None
        empty.find_element(By.CSS_SELECTOR, "button.train-first").click()  # no key yet
        err = browser.find_element(By.ID, "error")
        _wait(browser, lambda d: err.get_attribute("hidden") is None)
        assert "API key" in err.text
        browser.find_element(By.ID, "tab-jobs").click()
        nokey = browser.find_element(By.ID, "jobs-nokey")
        _wait(browser, lambda d: nokey.get_attribute("hidden") is None)
        assert "VIT_SERVICE_API_KEY" in nokey.text
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        browser.save_screenshot(str(SCREENSHOTS / "empty-jobs.png"))
    finally:
        s.stop()
