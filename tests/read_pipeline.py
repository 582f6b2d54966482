"""The `read` pipeline's steps, written once for the tests and the GPU pipeline
benchmark that serve it: a function scales the page's pixels, a fully
convolutional detector (``tests.onnx_models.conv_detector``, its model
``detector``) finds a peak, a function makes its box, crop_boxes cuts it from
the pixels as sent, the digits model (``digits``) reads the crop."""

from __future__ import annotations

STEPS = """[[pipelines.read.steps]]
name = "scale"
function = "tests.pipeline_functions:as_floats"
inputs = { pixels = "request.pixels" }
outputs = { x = "float32 [1, H, W]" }
[[pipelines.read.steps]]
name = "detect"
model = "detector"
inputs = { x = "scale.x" }
[[pipelines.read.steps]]
name = "peak"
function = "tests.pipeline_functions:peak_boxes"
inputs = { heat = "detect.heat" }
outputs = { boxes = "float32 [boxes, 4]" }
[[pipelines.read.steps]]
name = "crop"
op = "crop_boxes"
size = [8, 8]
inputs = { image = "request.pixels", boxes = "peak.boxes" }
[[pipelines.read.steps]]
name = "digit"
model = "digits"
inputs = { image = "crop.crops" }
"""
