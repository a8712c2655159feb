"""Launchers and checks around the training and evaluation entry points (vLLM servers, GPU smoke check).

Run them as modules from the repository root (``python -m scripts.serve_user_llm ...``) or as files
(``python scripts/serve_user_llm.py ...``).
"""
