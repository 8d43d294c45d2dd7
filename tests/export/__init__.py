"""ONNX export (dcmha.export) and Keras's own Model.export."""
