"""Which file names hold weights: the one list the readers (a remote folder's extras) and the planner (extras that
are never copied, `planning.extras`) share.

A name ending with one of `WEIGHT_SUFFIXES` (any case) holds weights of some framework, and so does an index of
such files (`*.index.json`): neither is ever a small file that travels beside a converted output.
"""

from __future__ import annotations

WEIGHT_SUFFIXES = {  # lower-case name suffix -> what such a file holds
    ".safetensors": "safetensors weights", ".bin": "PyTorch weights or training state (a pickle, or raw bytes)",
    ".pt": "PyTorch weights or training state", ".pth": "PyTorch weights or training state", ".ckpt": "a training checkpoint", ".distcp": "DCP weights", ".h5": "TensorFlow/Keras weights",
    ".hdf5": "TensorFlow/Keras weights", ".keras": "Keras weights", ".msgpack": "Flax weights", ".ot": "rust-bert (libtorch) weights",
    ".gguf": "GGUF weights", ".ggml": "GGML weights", ".onnx": "an ONNX model", ".onnx_data": "ONNX external weights",
    ".onnx.data": "ONNX external weights", ".npz": "NumPy arrays", ".npy": "a NumPy array", ".tflite": "a TensorFlow Lite model",
    ".pdparams": "PaddlePaddle weights", ".mlmodel": "a Core ML model", ".nemo": "a NeMo checkpoint",
}
TENSOR_SUFFIXES = tuple(WEIGHT_SUFFIXES)
INDEX_SUFFIX = ".index.json"


def names_weights(name: str) -> bool:
    """True when the file name `name` says it holds weights (or indexes weight files)."""
    lower = name.lower()
    return lower.endswith(TENSOR_SUFFIXES) or lower.endswith(INDEX_SUFFIX)


__all__ = ["INDEX_SUFFIX", "TENSOR_SUFFIXES", "WEIGHT_SUFFIXES", "names_weights"]
