"""report.html in a real browser (headless Chromium): from the pipeline to a pass's diff and to a
piece's kernel code, asserting what is on the screen; screenshots are kept (slow tier; skipped,
with the reason, where no browser can be started)."""

import os

import pytest

from tests.compile.browser import start, why_no_browser

pytestmark = pytest.mark.slow


@pytest.fixture
def browser():
    reason = why_no_browser()
    if reason:
        pytest.skip(reason)
    driver = start()
    yield driver
    driver.quit()


def test_click_from_the_pipeline_to_a_diff_and_to_kernel_code(browser, default_model_dump, tmp_path_factory):
    from selenium.webdriver.common.by import By

    shots = os.environ.get("COMPILELM_SCREENSHOTS") or str(tmp_path_factory.mktemp("screenshots"))
    os.makedirs(shots, exist_ok=True)
    browser.get(f"file://{default_model_dump / 'report.html'}")
    pipeline = browser.find_element(By.ID, "pipeline")
    assert "whole-graph passes" in pipeline.text and "Inductor" in pipeline.text
    browser.save_screenshot(os.path.join(shots, "report-pipeline.png"))

    # pipeline -> the RoPE + attention fusion's diff, opened and on screen
    diff = browser.find_element(By.ID, "pass-whole_graph-RopeAttentionFusionPass")
    assert diff.get_attribute("open") is None
    pipeline.find_element(By.LINK_TEXT, "RopeAttentionFusionPass (30)").click()
    assert diff.get_attribute("open") == "true"
    table = diff.find_element(By.CSS_SELECTOR, "table.diff")
    assert table.is_displayed() and "more like it, up to numbers" in diff.text
    assert "unified_attention_rotated" in table.text
    browser.save_screenshot(os.path.join(shots, "report-pass-diff.png"))

    # pipeline -> the layers' piece -> one of its kernels: the generated code on screen
    browser.find_element(By.ID, "pipeline").find_element(By.LINK_TEXT, "kernels of submod_2").click()
    kernel = browser.find_element(By.CSS_SELECTOR, "[id^='kernel-submod_2-dyn-'] summary code")
    name = kernel.text
    assert name.startswith(("cpp_fused", "triton_", "extern_kernels", "torch.ops"))
    kernel.click()
    code = kernel.find_element(By.XPATH, "../..").find_element(By.TAG_NAME, "pre")
    assert code.is_displayed() and name in code.text
    browser.save_screenshot(os.path.join(shots, "report-kernel.png"))

    browser.get(f"file://{default_model_dump / 'report.html'}#profile-decode")
    families = browser.find_element(By.ID, "profile-decode-families")
    assert families.is_displayed() and "GEMM" in families.text and "launch gaps" in families.text
    browser.save_screenshot(os.path.join(shots, "report-profile.png"))
    print(f"screenshots in {shots}")
