"""Sequence parallelism: the only package (with ``ringkv.parallel``) that communicates."""
