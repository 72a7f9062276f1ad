"""An independent plain-PyTorch reference of the models megatron_auto trains.

Written from the architectures' definitions (GPT-2/Megatron GPT, LLaMA-style variants, Megatron
BERT), not from the package: nothing here imports ``megatron_auto``, and the maths is spelled
out with elementary tensor operations (no ``F.scaled_dot_product_attention``, ``F.layer_norm``,
``F.gelu``, ``F.cross_entropy``), so that a mistake shared by the package's layers and kernels
cannot be shared by the reference. Training uses ``torch.optim.AdamW`` and
``torch.nn.utils.clip_grad_norm_`` as a user would.

``models.py`` holds the models and their initialisation rule, ``train.py`` the training loop.
``tests/test_reference_equivalence.py`` compares parallel plans of the package with it.
"""
