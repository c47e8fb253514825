"""Headless Chromium through Selenium, with Debian's chromium and chromium-driver (scripts/setup.sh
installs them where it can; nothing is downloaded when a test runs). Also a command that
screenshots a part of a report:

    python -m tests.compile.browser DIR/report.html '#profile' profile.png
"""

from __future__ import annotations

import shutil
import sys


def why_no_browser() -> str | None:
    """None when a headless browser can be started, else the reason."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (a test extra: pip install -e '.[test]')"
    if not (shutil.which("chromium") or shutil.which("chromium-browser")) or not shutil.which("chromedriver"):
        return "Debian's chromium and chromium-driver are not installed (apt-get install chromium chromium-driver)"
    return None


def start(width: int = 1400, height: int = 1000):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or shutil.which("chromium-browser")
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                f"--window-size={width},{height}"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)


def screenshot(page: str, anchor: str, out: str) -> None:
    driver = start()
    try:
        driver.get(f"file://{page}{anchor}")
        driver.save_screenshot(out)
    finally:
        driver.quit()


if __name__ == "__main__":
    import os

    screenshot(os.path.abspath(sys.argv[1]), sys.argv[2], sys.argv[3])
