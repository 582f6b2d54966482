"""``infer-worker config`` and ``run`` refuse the same configurations: every
refusal the guides document, fed to both as real processes (no broker listens:
each is refused before Kafka is contacted), each exit 2 with the same message
naming the key, never a traceback. And a configuration ``run`` serves passes
``config``: run then goes on to Kafka (exit 1, no broker), not exit 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

KAFKA = """
[metrics]
port = 0  # no port: these run side by side
[kafka]
bootstrap_servers = "127.0.0.1:1"  # nothing listens: every refusal comes first
request_timeout_ms = 2000
"""

TWO_MODELS = """
input_topics = ["scores", "texts"]
[models.scorer]
path = "builtin:digits"
topics = ["scores"]
[models.reader]
path = "builtin:sentiment"
topics = ["texts"]
"""

TWIN_MODELS = """
input_topics = ["a", "b"]
[gpu]
num_slots = 2
memory_fraction = 0.009
[models.first]
path = "builtin:digits"
backend = "gpu-twin"
topics = ["a"]
preprocess = { device = "gpu" }
[models.second]
path = "builtin:digits"
backend = "gpu-twin"
topics = ["b"]
preprocess = { device = "gpu" }
"""

PIPELINE = """
input_topics = ["scores", "texts"]
[model]
path = "builtin:digits"
topics = ["scores"]
[pipelines.chain]
topics = ["texts"]
outputs = {{ out = "d.topk_indices" }}
{first}
[[pipelines.chain.steps]]
name = "d"
model = "digits"
"""

FUNCTION_FIRST = """
[[pipelines.chain.steps]]
name = "f"
function = "tests.pipeline_functions:window"
inputs = { mel = "request.image" }
outputs = { frames = "float32 [76, 32, 1]" }
"""

# (configuration after [kafka], the key and message both commands must name)
REFUSED = [
    (TWO_MODELS.replace('"texts"]\n[models', '"texts", "third"]\n[models', 1),
     "kafka.input_topics: ['third'] answered by no model or pipeline"),
    (TWO_MODELS.replace('topics = ["texts"]', 'topics = ["scores"]'),
     "models.reader.topics: 'scores' is also models.scorer's: a topic belongs to one model"),
    (TWO_MODELS.replace('topics = ["texts"]', 'topics = ["elsewhere"]'),
     "models.reader.topics: ['elsewhere'] not in kafka.input_topics"),
    ('input_topics = ["a"]\n[model]\npath = "builtin:digits"\n[models.x]\n'
     'path = "builtin:digits"\ntopics = ["a"]\n', "model.topics: [model] answers no input topic"),
    (TWO_MODELS.replace('topics = ["scores"]', 'topics = ["scores"]\nbackend = "gpu-twin"')
     + 'backend = "torch"\n',
     "models.scorer.backend: 'gpu-twin' beside tensorrt or torch: the worker's one device"),
    (PIPELINE.format(first="").replace('topics = ["scores"]', 'topics = ["scores"]\n'
                                       "reload_interval_s = 5", 1),
     "model.reload_interval_s: a model a pipeline runs is not swapped while serving"),
    (TWO_MODELS + '[[kafka.lanes]]\ntopics = ["scores"]\npriority = 0\n[[kafka.lanes]]\n'
     'topics = ["texts"]\npriority = 1\nown_process = true\n',
     "kafka.lanes[1].own_process: a lane in a process of its own serves one model's"),
    ('state_topic = "states"\n' + TWO_MODELS,
     "kafka.state_topic: with several models, name each stateful model's changelog"),
    (TWO_MODELS.replace('topics = ["texts"]', 'topics = ["texts"]\nstate_topic = "scores"'),
     "models.reader.state_topic: must be a topic of its own"),
    (PIPELINE.format(first=FUNCTION_FIRST),
     "pipelines.chain.steps[0]: the first step is a model"),
    # Declared request tensors: a step reading one not declared; a model's input no
    # step feeds (refused once the model loads).
    (PIPELINE.format(first=FUNCTION_FIRST).replace(
        "[pipelines.chain]\n", '[pipelines.chain]\ninputs = { pixels = "uint8 [H, W, 1]" }\n'),
     "pipelines.chain.steps[0].inputs.mel: 'request.image': the request's declared tensors "
     "are pixels"),
    (PIPELINE.format(first="").replace(
        "[pipelines.chain]\n", '[pipelines.chain]\ninputs = { pixels = "uint8 [H, W, 1]" }\n'),
     "pipelines.chain.steps[0].inputs.image: 'request.image' does not exist; the request's "
     "tensor inputs: pixels"),
    (PIPELINE.format(first="") + 'when = "d.topk_indices"\n',
     "pipelines.chain.steps[0].when: 'd.topk_indices': 'd' is not an earlier step"),
    (PIPELINE.format(first="").replace('model = "digits"', 'model = "translator"'),
     "pipelines.chain.steps[0].model: 'translator' is not a model this worker serves"),
    # Refused only once the models load: a tensor, an output, the memory budget.
    (PIPELINE.format(first="").replace('"d.topk_indices"', '"d.nope"'),
     "pipelines.chain.outputs.out: 'd.nope'"),
    (TWO_MODELS + 'outputs = ["nope"]\n', "models.reader.outputs"),
    (TWO_MODELS + "[limits]\nmax_models_memory_mb = 1\n",
     "limits.max_models_memory_mb: the models hold"),
    # The Schema Registry cannot be reached: the result schema is not registered.
    (TWO_MODELS + '[schema_registry]\nurl = "http://127.0.0.1:1"\nrequest_timeout_ms = 500\n',
     "schema_registry.url: registering the avro result schema under 'infer.results-value' "
     "failed"),
    # Two GPU models (on the GPU stage's CPU twin) whose slot rings together exceed
    # half the process's share of the device: the second is refused naming the first.
    (TWIN_MODELS, "the slot ring alone needs 64 MiB (2 slots x 32 MiB: every input, output "
     "and staging buffer at batching.max_batch_size rows), beside first 64 MiB"),
]  # fmt: skip


def _run(command: str, path: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFER_WORKER_")}
    return subprocess.run(
        [sys.executable, "-m", "worker", command, "--config", str(path)],
        capture_output=True, text=True, timeout=120, env=env, check=False,
    )  # fmt: skip


@pytest.mark.parametrize(("text", "message"), REFUSED, ids=[m[:40] for _, m in REFUSED])
def test_config_and_run_refuse_alike(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "worker.toml"
    path.write_text(KAFKA + text)
    for command in ("config", "run"):
        done = _run(command, path)
        assert done.returncode == 2, (command, done.stderr[-2000:])
        assert message in done.stderr, (command, done.stderr[-2000:])
        assert "Traceback" not in done.stderr, (command, done.stderr[-2000:])
        assert done.stdout == "" or command == "run", done.stdout  # config prints nothing


@pytest.mark.parametrize(
    "text",
    [
        TWO_MODELS,  # [models.NAME] sections alone
        # [model] with topics of its own beside a [models.NAME]: refused by run alone
        # once ('model.topics: ['combiner.requests'] in kafka.input_topics but served
        # by no model'), though config passed it.
        'input_topics = ["scores", "combiner.requests"]\n[model]\ntopics = ["scores"]\n'
        '[models.combiner]\npath = "builtin:digits"\ntopics = ["combiner.requests"]\n',
    ],
    ids=["models-alone", "model-topics-beside-models"],
)
def test_what_config_passes_run_serves_until_kafka(tmp_path: Path, text: str) -> None:
    path = tmp_path / "worker.toml"
    path.write_text(KAFKA + text)
    shown = _run("config", path)
    assert shown.returncode == 0 and '"bootstrap_servers": "127.0.0.1:1"' in shown.stdout
    ran = _run("run", path)
    assert ran.returncode == 1, ran.stderr[-2000:]  # the models served; then no broker
    assert "kafka.bootstrap_servers: no Kafka broker answers" in ran.stderr


def test_settings_only_loads_no_model(tmp_path: Path) -> None:
    """``config --settings-only``: a configuration whose model cannot load here
    (a GPU one on a laptop) is printed; the settings' own mistakes still exit 2."""
    path = tmp_path / "worker.toml"
    path.write_text(KAFKA + 'input_topics = ["a"]\n[model]\npath = "/nowhere/model.onnx"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFER_WORKER_")}
    argv = [sys.executable, "-m", "worker", "config", "--config", str(path)]
    loaded = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env,
                            check=False)  # fmt: skip
    assert loaded.returncode == 2 and "/nowhere/model.onnx" in loaded.stderr
    only = subprocess.run([*argv, "--settings-only"], capture_output=True, text=True,
                          timeout=120, env=env, check=False)  # fmt: skip
    assert only.returncode == 0 and '"/nowhere/model.onnx"' in only.stdout, only.stderr
    path.write_text(KAFKA + TWO_MODELS.replace('"texts"]\n[models', '"texts", "x"]\n[models', 1))
    wrong = subprocess.run([*argv, "--settings-only"], capture_output=True, text=True,
                           timeout=120, env=env, check=False)  # fmt: skip
    assert wrong.returncode == 2 and "answered by no model or pipeline" in wrong.stderr


def _repository(root: Path) -> Path:
    """Two models of the bundled digits file, scorer (versions 1 and 2, settings for
    both) and reader (version 1, settings of its own)."""
    import shutil

    from worker.model.files import bundled_file

    repo = root / "models"
    for name, version in (("scorer", 1), ("scorer", 2), ("reader", 1)):
        (repo / name / str(version)).mkdir(parents=True)
        shutil.copy(bundled_file("digits.onnx"), repo / name / str(version) / "model.onnx")
    (repo / "scorer" / "model.toml").write_text('topics = ["scores"]\ninput = "image"\n')
    (repo / "reader" / "1" / "model.toml").write_text('topics = ["texts"]\ninput = "image"\n')
    return repo


REPOSITORY = 'input_topics = ["scores", "texts"]\n[repository]\npath = "{repo}"\n'

# (a change to the repository, the configuration after [kafka], the message both name)
REPOSITORY_REFUSED = [
    ("", REPOSITORY.replace("{repo}", "{repo}/nowhere"), "repository.path: {repo}/nowhere is "
     "not a directory"),
    ("mkdir scorer/v3", REPOSITORY, "repository.path: {repo}/scorer/v3: a model's directories "
     "are its versions"),
    ("mkdir scorer/3", REPOSITORY, "repository.path: {repo}/scorer/3: no model file"),
    ("settings scorer batch = 4", REPOSITORY, "{repo}/scorer/model.toml: unknown key batch"),
    ("", REPOSITORY + 'latest = 2\n', "repository.latest: names 2 versions of 'scorer' (1, 2)"),
    ("", REPOSITORY + '[models.reader]\npath = "builtin:digits"\n',
     "models.reader: 'reader' is also a model of the repository"),
    # Refused only once the model loads, named as the repository model it is.
    ("settings scorer outputs = [\"nope\"]", REPOSITORY,
     "repository.scorer.outputs: 'nope' not in model outputs"),
]  # fmt: skip


@pytest.mark.parametrize(("change", "text", "message"), REPOSITORY_REFUSED,
                         ids=[m[:40] for _, _, m in REPOSITORY_REFUSED])  # fmt: skip
def test_config_and_run_refuse_a_bad_repository_alike(
    tmp_path: Path, change: str, text: str, message: str
) -> None:
    repo = _repository(tmp_path)
    verb, _, rest = change.partition(" ")
    if verb == "mkdir":
        (repo / rest).mkdir()
    elif verb == "settings":
        model, _, line = rest.partition(" ")
        settings = repo / model / "model.toml"
        settings.write_text(settings.read_text() + line + "\n")
    path = tmp_path / "worker.toml"
    path.write_text(KAFKA + text.replace("{repo}", str(repo)))
    for command in ("config", "run"):
        done = _run(command, path)
        assert done.returncode == 2, (command, done.stderr[-2000:])
        assert message.replace("{repo}", str(repo)) in done.stderr, (command, done.stderr[-2000:])
        assert "Traceback" not in done.stderr, (command, done.stderr[-2000:])


def test_what_config_passes_of_a_repository_run_serves_until_kafka(tmp_path: Path) -> None:
    path = tmp_path / "worker.toml"
    path.write_text(KAFKA + REPOSITORY.replace("{repo}", str(_repository(tmp_path))))
    shown = _run("config", path)
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert '"scorer": {' in shown.stdout and '"reader": {' in shown.stdout
    ran = _run("run", path)
    assert ran.returncode == 1, ran.stderr[-2000:]  # the models served; then no broker
    assert "kafka.bootstrap_servers: no Kafka broker answers" in ran.stderr
