"""GGUF, llama.cpp's single-file format: everything the workbench knows about writing it.

`container.py` lays out and writes the file (`GgufOutput`, registered as `to="gguf"`); `metadata.py` makes
llama.cpp's key/values from config.json; `vocab.py` chooses the tokenizer route (`hf_vocab.py`, `bpe_vocab.py`,
`tokenizer_json.py`), `packed.py` keeps vocabulary arrays as their GGUF bytes; `rope.py` makes the tensors
llama.cpp's converter generates from config.json. The row kernels the engine runs (quantisers, the q/k
permutation, FP8 de-quantisation) belong to the preset's operations, in `workbench.mapper`.
"""
