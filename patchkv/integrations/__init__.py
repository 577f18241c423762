"""Engine integrations, each importing its engine only when imported itself (`patchkv.integrations.vllm`):
`import patchkv` never needs one."""
