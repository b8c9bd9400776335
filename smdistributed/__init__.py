"""Drop-in for Amazon SageMaker's ``smdistributed`` namespace, provided by smp2ds.

Only ``smdistributed.modelparallel`` (SMP v1) is provided; it runs on DeepSpeed. Hugging Face
``transformers`` detects SMP by finding this package (``importlib.util.find_spec``).
"""
