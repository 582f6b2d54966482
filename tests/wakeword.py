"""The openWakeWord pipeline the pipeline tests and ``benchmarks.pipeline`` serve:
its melspectrogram model, the window function (``tests.pipeline_functions``) and
its embedding model, as ``[pipelines.wakeword]``, written once."""

from __future__ import annotations

from tests import real_models

EMBEDDING = 'embedding = "embed.conv2d_19"'


def wakeword_toml(
    topic: str,
    *,
    outputs: str = EMBEDDING,
    mel_topic: str = "",
    frames: str = "float32 [76, 32, 1]",
    source: str = "window.frames",
) -> str:
    """The worker's TOML for the pipeline answering ``topic``: ``outputs`` its
    outputs (inline-table entries), ``mel_topic`` the mel step's own topic (""
    none), ``frames`` the window's declared output, ``source`` what the
    embedding model reads (the last two changed by the start-up check tests)."""
    mel_step_topic = f'topic = "{mel_topic}"\n' if mel_topic else ""
    return f"""
[model]
name = "melspec"
path = "{real_models.model_path("oww-melspectrogram")}"
[models.embedding]
path = "{real_models.model_path("oww-embedding")}"
[pipelines.wakeword]
topics = ["{topic}"]
outputs = {{ {outputs} }}
[[pipelines.wakeword.steps]]
name = "mel"
model = "melspec"
{mel_step_topic}[[pipelines.wakeword.steps]]
name = "window"
function = "tests.pipeline_functions:mel_window"
inputs = {{ mel = "mel.output" }}
outputs = {{ frames = "{frames}" }}
[[pipelines.wakeword.steps]]
name = "embed"
model = "embedding"
inputs = {{ input_1 = "{source}" }}
"""
