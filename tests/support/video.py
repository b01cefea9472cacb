"""A short video written with OpenCV, its decoded frames and its data URL, and the workaround the notes give for stock
vLLM."""

from __future__ import annotations

import base64
from pathlib import Path
import numpy as np


#: The workaround the notes give for stock vLLM (it skips the processor-name look-up).
WORKAROUND = {"video": {"video_backend": "opencv"}}
FRAMES, WIDTH, HEIGHT, FPS = 8, 64, 48, 4


def write_video(path: Path, frames: int = FRAMES, width: int = WIDTH, height: int = HEIGHT, fps: int = FPS) -> Path:
    """An mp4 (``mp4v``) of ``frames`` frames of ``width`` x ``height``, each a different gradient, written with
    OpenCV's ``VideoWriter``. Raises if OpenCV writes nothing."""
    import cv2

    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps, (width, height))
    assert writer.isOpened(), f"OpenCV cannot write {path}"
    yy, xx = np.mgrid[0:height, 0:width]
    for i in range(frames):
        frame = np.stack([(xx * 4 + i * 30) % 256, (yy * 5 + i * 17) % 256, np.full_like(xx, i * 31 % 256)], -1)
        writer.write(frame.astype(np.uint8))
    writer.release()
    assert path.stat().st_size > 0, path
    return path


def decoded_frames(path: Path) -> np.ndarray:
    """Every frame OpenCV decodes from ``path``, RGB, ``(frames, height, width, 3)`` uint8."""
    import cv2

    cap = cv2.VideoCapture(str(path))
    out = []
    while True:
        ok, frame = cap.read()
        if not ok:
            break
        out.append(cv2.cvtColor(frame, cv2.COLOR_BGR2RGB))
    cap.release()
    return np.stack(out)


def data_url(path: Path) -> str:
    return "data:video/mp4;base64," + base64.b64encode(path.read_bytes()).decode()

