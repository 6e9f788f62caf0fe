"""The HTML report as a person sees it: opened in headless Chromium (Debian's
chromium-headless-shell, which `make install` adds when it can), its screenshot holds the
rendered figure, not a blank or broken page."""
from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest
from PIL import Image
from synthetic_run import write_synthetic_run

from launcher.report import write_report
from services.protocol import ExpDir

BROWSER = shutil.which("chromium-headless-shell") or shutil.which("chromium")


@pytest.mark.skipif(BROWSER is None, reason="no headless Chromium (apt-get install chromium-headless-shell)")
def test_the_report_page_renders_its_figure(tmp_path):
    exp = ExpDir(tmp_path / "run")
    write_synthetic_run(exp, n_steps=40)
    _, page, _ = write_report(exp)
    shot = tmp_path / "shot.png"
    subprocess.run([BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    f"--screenshot={shot}", "--window-size=1200,1800", page.as_uri()],
                   check=True, capture_output=True, timeout=60)
    image = Image.open(shot).convert("RGB")
    assert image.size == (1200, 1800)
    pixels = np.asarray(image).reshape(-1, 3).astype(int)
    inked = float((pixels != 255).any(axis=1).mean())
    colours = len(np.unique(pixels, axis=0))
    # The figure's panels (axes, bars, curves) cover a good part of the page in many colours; a
    # blank page, a missing image or a bare error text does not.
    assert inked > 0.10, f"only {inked:.1%} of the page is not white"
    assert colours > 200, f"only {colours} distinct colours"
    # The red of the held-out curve and the blue of the rollout bars made it to the screen.
    r, g, b = pixels.T
    assert ((r > 180) & (g < 80) & (b < 80)).any()
    assert ((b > 150) & (r < 100)).any()
