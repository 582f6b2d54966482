"""Builds the bundled stateful model ``builtin:sensor`` and its demo streams.

    .venv/bin/python scripts/build_sensor_model.py

An anomaly detector per sensor (the record key is the sensor): each request is
one reading ``x`` float32 [1]; the model keeps the sensor's running mean and
variance as two state inputs (``mean`` [batch, 1], initial 0; ``var`` [batch, 1],
initial 1) and returns ``score`` = (x - mean)^2 / (var + 1e-3), the squared
z-score of the reading against the sensor's own history, with the next mean and
variance (``meanN``, ``varN``: exponential moving estimates, weight 0.1). A
reading scoring over 9 (three standard deviations) is an anomaly.

Writes worker/model/bundled/sensor.onnx, sensor_samples.npz (24 sensors x 40
readings, each sensor its own level and noise, 5% spikes of 6-10 standard
deviations, labelled) and sensor.json (what the offline run scores).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

OUT = Path(__file__).resolve().parents[1] / "worker" / "model" / "bundled"
ALPHA, EPS, THRESHOLD = 0.1, 1e-3, 9.0
SENSORS, READINGS = 24, 40


def model() -> onnx.ModelProto:
    f32 = TensorProto.FLOAT
    io = [helper.make_tensor_value_info(n, f32, ["batch", 1]) for n in ("x", "mean", "var")]
    outs = [helper.make_tensor_value_info(n, f32, ["batch", 1]) for n in ("score", "meanN", "varN")]
    const = [
        helper.make_tensor("alpha", f32, [], [ALPHA]),
        helper.make_tensor("keep", f32, [], [1.0 - ALPHA]),
        helper.make_tensor("eps", f32, [], [EPS]),
    ]
    nodes = [
        helper.make_node("Sub", ["x", "mean"], ["d"]),
        helper.make_node("Mul", ["d", "d"], ["d2"]),
        helper.make_node("Add", ["var", "eps"], ["var_eps"]),
        helper.make_node("Div", ["d2", "var_eps"], ["score"]),
        helper.make_node("Mul", ["alpha", "d"], ["step"]),
        helper.make_node("Add", ["mean", "step"], ["meanN"]),
        helper.make_node("Mul", ["alpha", "d2"], ["spread"]),
        helper.make_node("Add", ["var", "spread"], ["var_spread"]),
        helper.make_node("Mul", ["keep", "var_spread"], ["varN"]),
    ]
    graph = helper.make_graph(nodes, "sensor", io, outs, initializer=const)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.checker.check_model(m)
    return m


def streams() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(28)
    level = rng.uniform(-5, 5, (SENSORS, 1))
    noise = rng.uniform(0.5, 2.0, (SENSORS, 1))
    readings = level + noise * rng.normal(0, 1, (SENSORS, READINGS))
    labels = np.zeros((SENSORS, READINGS), np.int64)
    spikes = rng.random((SENSORS, READINGS)) < 0.05
    spikes[:, :8] = False  # a sensor's estimates settle first
    sign = rng.choice([-1.0, 1.0], (SENSORS, READINGS))
    readings[spikes] += (sign * noise * rng.uniform(6, 10, (SENSORS, READINGS)))[spikes]
    labels[spikes] = 1
    return readings.astype(np.float32), labels


def main() -> None:
    m = model()
    onnx.save(m, OUT / "sensor.onnx")
    readings, labels = streams()
    np.savez(OUT / "sensor_samples.npz", readings=readings, labels=labels)
    import onnxruntime as ort

    session = ort.InferenceSession(str(OUT / "sensor.onnx"), providers=["CPUExecutionProvider"])
    correct = 0
    for s in range(SENSORS):
        mean, var = np.zeros((1, 1), np.float32), np.ones((1, 1), np.float32)
        for t in range(READINGS):
            x = readings[s, t].reshape(1, 1)
            score, mean, var = session.run(None, {"x": x, "mean": mean, "var": var})
            correct += int((float(score[0, 0]) > THRESHOLD) == bool(labels[s, t]))
    total = SENSORS * READINGS
    record = {"sensors": SENSORS, "readings": READINGS, "anomalies": int(labels.sum()),
              "threshold": THRESHOLD, "offline_correct": correct, "accuracy": correct / total}
    (OUT / "sensor.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record))


if __name__ == "__main__":
    main()
