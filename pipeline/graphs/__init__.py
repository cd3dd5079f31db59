"""The core's graphs: the deployed graphs: their interface (graph_io), the ONNX node recipes, the reference generation loop."""
