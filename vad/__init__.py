"""Server-side voice activity detection: Silero v6 on onnxruntime, batched across sessions."""
