"""Postprocessing on the host (NumPy): softmax and top-k per row.

The GPU path computes the same on device before the device-to-host copy; this is
the reference it is compared with.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from worker.config import PostprocessConfig


def softmax(logits: np.ndarray) -> npt.NDArray[np.float32]:
    x = logits.astype(np.float32, copy=False)
    shifted = x - x.max(axis=-1, keepdims=True)  # stable: exp never overflows
    e = np.exp(shifted)
    out: npt.NDArray[np.float32] = e / e.sum(axis=-1, keepdims=True)
    return out


def top_k(scores: np.ndarray, k: int) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]:
    """Indices and values of the k largest entries per row, descending; ties go to
    the lower index so results are deterministic."""
    k = min(k, scores.shape[-1])
    order = np.argsort(-scores, axis=-1, kind="stable")[..., :k]
    values = np.take_along_axis(scores, order, axis=-1)
    return order.astype(np.int64), values.astype(np.float32)


def l2_normalize(x: np.ndarray) -> npt.NDArray[np.float32]:
    """Unit length along the last axis (embeddings); an all-zero row stays zero."""
    v = x.astype(np.float32, copy=False)
    norm = np.sqrt(np.einsum("...i,...i->...", v, v))[..., None]
    out: npt.NDArray[np.float32] = v / np.maximum(norm, np.float32(1e-12))
    return out


def postprocess(raw: np.ndarray, cfg: PostprocessConfig, raw_name: str) -> dict[str, np.ndarray]:
    """Batch-level outputs keyed by wire name; each array's first dim is the batch.
    Settings left to their derived defaults take the classifier's (softmax, top 3):
    stages pass settings already resolved for their model."""
    cfg = cfg.resolved(classifier=True)
    assert cfg.top_k is not None
    out: dict[str, np.ndarray] = {}
    if cfg.include_raw:
        out[raw_name] = raw
    if cfg.normalize:
        out[raw_name] = l2_normalize(raw)
    if cfg.top_k > 0:
        scores = softmax(raw) if cfg.softmax else raw.astype(np.float32, copy=False)
        flat = scores.reshape(scores.shape[0], -1)
        out["topk_indices"], out["topk_scores"] = top_k(flat, cfg.top_k)
    elif cfg.softmax:
        out["probabilities"] = softmax(raw)
    return out
