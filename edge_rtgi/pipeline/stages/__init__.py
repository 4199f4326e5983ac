"""Pipeline stages: ASR, assistant / translate, TTS (see edge_rtgi.pipeline.build)."""
