"""DTP in training frameworks: `huggingface.DTPTrainerCallback` for transformers' Trainer,
`lightning.DTPCallback` for PyTorch Lightning. Each module imports its framework, so
import the one you use."""
