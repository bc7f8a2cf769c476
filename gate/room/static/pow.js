// The join's proof of work, off the page's thread (gate/room/gates.py's rule):
// a nonce such that SHA-256(challenge + ":" + nonce) starts with `bits` zero bits.
// Nonces are lowercase hex counters, as gate.room.gates.solve writes them.
"use strict";

// Digests in flight at once: WebCrypto answers each in a promise, so a batch keeps
// the worker busy without one await per hash.
const BATCH = 256;
const encoder = new TextEncoder();

function leadingZeroBits(digest, bits) {
  let i = 0;
  for (; bits >= 8; bits -= 8, i++) {
    if (digest[i] !== 0) return false;
  }
  return bits === 0 || (digest[i] >> (8 - bits)) === 0;
}

async function solve(challenge, bits) {
  const prefix = challenge + ":";
  for (let start = 0; ; start += BATCH) {
    const nonces = [];
    const digests = [];
    for (let n = start; n < start + BATCH; n++) {
      const nonce = n.toString(16);
      nonces.push(nonce);
      digests.push(crypto.subtle.digest("SHA-256", encoder.encode(prefix + nonce)));
    }
    const done = await Promise.all(digests);
    for (let k = 0; k < done.length; k++) {
      if (leadingZeroBits(new Uint8Array(done[k]), bits)) return nonces[k];
    }
  }
}

self.onmessage = async (event) => {
  const { challenge, bits } = event.data;
  try {
    self.postMessage({ nonce: await solve(String(challenge), Number(bits)) });
  } catch (err) {
    self.postMessage({ error: String(err) });
  }
};
