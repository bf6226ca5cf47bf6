"""Train a small Kimi-K3 on the Python standard library's own source (`k3stream train-tiny`).

The model is the inference model itself (`k3stream.model`), built from float tensors that require
grad, so training and inference share one implementation of KDA, MLA, attention residuals and the
latent MoE. The result is written through the GGUF writer (`k3stream.gguf.writer.write_model`).
"""
