"""Debian's Chromium driven by Selenium, for tests/server/test_console.py and bench/console_screenshots.py.

Both executables are named, so Selenium Manager never looks for (or downloads)
a browser or a driver. The flags keep headless Chromium off the network, which
is closed here; each driver gets a fresh profile.
"""

from __future__ import annotations

import os
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.remote.webdriver import WebDriver

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
)
WIDTH, HEIGHT = 1280, 800


def missing() -> str | None:
    """Why the browser cannot run here, or None."""
    for path in (CHROMIUM, CHROMEDRIVER):
        if not os.access(path, os.X_OK):
            return f"{path} is not installed (apt-get install chromium chromium-driver)"
    return None


def chromium(profile: Path, log: Path) -> WebDriver:
    """A headless Chromium whose viewport is exactly 1280 by 800."""
    options = Options()
    options.binary_location = CHROMIUM
    for flag in (*FLAGS, f"--user-data-dir={profile}", f"--window-size={WIDTH},{HEIGHT}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(
        options=options, service=Service(executable_path=CHROMEDRIVER, log_output=str(log))
    )
    driver.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride",
        {"width": WIDTH, "height": HEIGHT, "deviceScaleFactor": 1, "mobile": False},
    )
    driver.set_page_load_timeout(30)
    return driver


def color_scheme(driver: WebDriver, scheme: str) -> None:
    """Emulate ``prefers-color-scheme`` (``light`` or ``dark``)."""
    driver.execute_cdp_cmd(
        "Emulation.setEmulatedMedia", {"features": [{"name": "prefers-color-scheme", "value": scheme}]}
    )
