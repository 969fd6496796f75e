//! A simulated vLLM server (see `../shared/vllm-protocol.md`), for tests and the demo.
