"""The image classifiers (ViT and Swin backbones): ``config``
(:class:`~.config.VisionConfig`) and ``flags`` (``pretrain_vision_classify.py``'s flags).
Imports nothing, so that the models can read the config."""
