// The reference GPT-2 encoder for tests/gpt/tokenizer_test.cc and
// benchmarks/tokenizer/tokenizer_bench.cc: the npm package gpt-3-encoder's own encode().
//
//   node reference_encode.js PACKAGE_DIR FILE...
//       one line per FILE: its token ids, space-separated
//   node reference_encode.js PACKAGE_DIR --bench REPS FILE
//       line 1: "seconds_first seconds_best" of REPS encodes of FILE, the clock around the
//       encode calls only; line 2: the ids of the last one. The text goes to encode() in
//       lines cut where the cut cannot change the tokens (after "\n" that follows a non-space,
//       before a non-space: GPT-2's pattern always ends a piece there), because the package's
//       encode() is quadratic in the length of its input (it concatenates the output arrays).
//
// FILE is read as UTF-8 (invalid bytes become U+FFFD), as the package's users read text.
'use strict';
const fs = require('fs');
const path = require('path');

const args = process.argv.slice(2);
if (args.length < 2 || (args[1] === '--bench' && args.length !== 4)) {
  process.stderr.write('usage: reference_encode.js PACKAGE_DIR FILE... | PACKAGE_DIR --bench REPS FILE\n');
  process.exit(2);
}
const encoder = require(path.resolve(args[0]));
if (args[1] !== '--bench') {
  for (const file of args.slice(1)) {
    process.stdout.write(encoder.encode(fs.readFileSync(file, 'utf8')).join(' ') + '\n');
  }
} else {
  const chunks = fs.readFileSync(args[3], 'utf8').split(/(?<=\S\n)(?=\S)/u);
  let first = 0, best = Infinity, ids = [];
  for (let rep = 0; rep < Number(args[2]); rep++) {
    ids = [];
    const start = process.hrtime.bigint();
    for (const chunk of chunks) ids.push(encoder.encode(chunk));
    const seconds = Number(process.hrtime.bigint() - start) / 1e9;
    if (rep === 0) first = seconds;
    best = Math.min(best, seconds);
  }
  process.stdout.write(first + ' ' + best + '\n' + ids.flat().join(' ') + '\n');
}
