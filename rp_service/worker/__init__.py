"""The worker side of a job: `python -m rp_service.worker JOB_DIR` runs one attempt of it.

main        the process: signals, the event pipe, the failure report
training    one attempt: model, optimizer, the training loop, evaluation and output
checkpoint  the checkpoint format (write to a temporary directory, rename into place)
modeling    the model a spec names (a preset with random weights, or a local HF folder)
objectives  train.objective dpo: the DPO loss, its pairs, its reference
"""
