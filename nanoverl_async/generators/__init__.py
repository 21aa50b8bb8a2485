"""Generators: engines that decode (our continuous-batching engine, SGLang) and the worker that streams episodes."""
