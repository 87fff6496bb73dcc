"""Batch jobs (the OpenAI batch format): their files, their store and the worker."""
