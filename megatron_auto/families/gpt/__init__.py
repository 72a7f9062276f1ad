"""The GPT (causal decoder) and BERT (encoder) families: ``family`` registers both. Their config
is the package's shared ``config.ModelConfig`` and their flags are ``arguments.py``'s model
flags, which the other families build on. Imports nothing."""
