"""The playground in a real headless Chromium (Debian's chromium + chromium-driver, driven by
selenium): the page loads, a prompt streams, accepted draft tokens are highlighted, the
text is the plain-decoding text, and a screenshot is saved (tests/artifacts/playground.png).
Without Chromium the test is skipped on a workstation and FAILS on CI."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

ARTIFACTS = Path(__file__).parent / "artifacts"
PROMPT = "def median(values):\n"


def chromium_paths() -> tuple[str, str]:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if browser and driver:
        return browser, driver
    missing = "Chromium and chromedriver (apt-get install chromium chromium-driver; `make test` does it as root)"
    if os.environ.get("CI"):
        pytest.fail(f"the playground test needs {missing}")
    pytest.skip(f"needs {missing}")


@pytest.fixture
def browser():
    if not os.environ.get("CI"):  # on CI selenium is installed (dev extra): a missing one fails
        pytest.importorskip("selenium")
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    binary, driver = chromium_paths()
    options = Options()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,860"):
        options.add_argument(arg)
    chrome = webdriver.Chrome(options=options, service=Service(driver))
    yield chrome
    chrome.quit()


def test_playground_streams_and_highlights_draft_tokens(server, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from quickdraft import SpeculativeGenerator

    expected = SpeculativeGenerator.from_pretrained(method="ar").generate(PROMPT, max_new_tokens=40).text
    browser.get(server.url + "/")
    find = lambda element_id: browser.find_element(By.ID, element_id)  # noqa: E731
    WebDriverWait(browser, 20).until(lambda b: "qd-stdlib-target" in find("model-info").text)
    prompt = find("prompt")
    prompt.clear()
    prompt.send_keys(PROMPT)
    max_tokens = find("max-tokens")
    max_tokens.clear()
    max_tokens.send_keys("40")
    find("generate").click()
    WebDriverWait(browser, 60).until(lambda b: find("status").text.startswith(("done", "stopped", "4", "5")))
    assert find("status").text == "done (length)"
    completion = find("completion")
    assert completion.get_attribute("textContent") == expected
    highlighted = completion.find_elements(By.CSS_SELECTOR, "span.draft")
    assert highlighted and all(span.text or span.get_attribute("textContent") for span in highlighted)
    assert find("stat-tokens").text == "40"
    assert float(find("stat-mean").text) > 1  # more than one token per target pass
    assert find("stat-acceptance").text.endswith(")")  # the final timings arrived
    # The chart drew bars: its canvas has green pixels.
    green = browser.execute_script(
        "const c = document.getElementById('chart'); const d = c.getContext('2d')"
        ".getImageData(0, 0, c.width, c.height).data; let n = 0;"
        "for (let i = 0; i < d.length; i += 4) if (d[i+1] > 150 && d[i] < 100) n++; return n;")
    assert green > 100
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "playground.png"
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
    print(f"playground screenshot: {shot}")
