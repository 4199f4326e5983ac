// Microphone capture for the native protocol: mono float32 at the AudioContext's rate in,
// 16 kHz PCM16 out, posted to the page in 20 ms chunks (320 samples, transferred, not copied).
// The resampler interpolates linearly after a one-pole low-pass at about 7 kHz, enough for
// speech recognition (whisper reads 16 kHz) and cheap on the audio thread.

const TARGET_RATE_HZ = 16000;
const CHUNK_SAMPLES = 320;

class PcmCapture extends AudioWorkletProcessor {
  constructor() {
    super();
    this.step = sampleRate / TARGET_RATE_HZ; // input samples per output sample
    this.pos = 0; // fractional read position into the current block (may be negative: previous)
    this.prev = 0; // last low-passed input sample of the previous block
    this.lp = 0;
    // one-pole low-pass coefficient for a ~7 kHz cut-off at this rate
    this.alpha = 1 - Math.exp((-2 * Math.PI * 7000) / sampleRate);
    this.chunk = new Int16Array(CHUNK_SAMPLES);
    this.fill = 0;
  }

  process(inputs) {
    const input = inputs[0] && inputs[0][0];
    if (!input) return true;
    const n = input.length;
    const filtered = new Float32Array(n);
    let lp = this.lp;
    for (let i = 0; i < n; i++) {
      lp += this.alpha * (input[i] - lp);
      filtered[i] = lp;
    }
    this.lp = lp;
    let pos = this.pos;
    while (pos < n - 1) {
      const i = Math.floor(pos);
      const frac = pos - i;
      const a = i < 0 ? this.prev : filtered[i];
      const b = filtered[i + 1];
      const s = Math.max(-1, Math.min(1, a + (b - a) * frac));
      this.chunk[this.fill++] = s < 0 ? s * 0x8000 : s * 0x7fff;
      if (this.fill === CHUNK_SAMPLES) {
        this.port.postMessage(this.chunk.buffer, [this.chunk.buffer]);
        this.chunk = new Int16Array(CHUNK_SAMPLES);
        this.fill = 0;
      }
      pos += this.step;
    }
    this.prev = filtered[n - 1];
    this.pos = pos - n; // carry the fraction into the next block
    return true;
  }
}

registerProcessor("pcm-capture", PcmCapture);
