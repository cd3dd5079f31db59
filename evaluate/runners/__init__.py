"""Runners: one module per runtime, each computing one side of a comparison for the same tokens.

  pytorch     the reference: the model's own blocks in float32, layer by layer (resident or streamed)
  ort         ONNX Runtime, whole graphs: declarations, logits of a graph without per-layer values,
              the deployed generation loop
  ort_layers  ONNX Runtime, a deployed graph cut into pieces (embedding, each layer, head) run layer
              by layer: where per-layer values come from
  sharded     the training checkpoint under its own TP/PP layout: training's sharded forward process
  om          the ATC .om through ais_bench on an Ascend host

Every value comes back on the CPU as torch tensors (``outputs.Outputs``, or through a sink).
"""
