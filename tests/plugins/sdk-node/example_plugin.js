#!/usr/bin/env node
// SDK-layout fixture plugin of the Cloud Agents tests (no dependencies): line-delimited JSON-RPC 2.0, Executa v1
// (`initialize` is answered method-not-found), `describe`, `health`, and `invoke` of `word_count {text}`.
'use strict';
const readline = require('readline');

const MANIFEST = {
  name: 'example-node-tool',
  version: '1.0.0',
  description: 'Counts words (SDK-layout fixture).',
  tools: [{ name: 'word_count', description: 'Count the words of a text.',
    parameters: [{ name: 'text', type: 'string', description: 'The text.', required: true }] }],
};

function handle(req) {
  switch (req.method) {
    case 'describe':
      return { result: MANIFEST };
    case 'health':
      return { result: { status: 'ready' } };
    case 'invoke': {
      const params = req.params || {};
      if (params.tool !== 'word_count') return { error: { code: -32601, message: `unknown tool: ${params.tool}` } };
      const text = (params.arguments || {}).text || '';
      const words = text.split(/\s+/).filter((w) => w.length > 0).length;
      return { result: { success: true, data: { words, runtime: 'node' } } };
    }
    default:
      return { error: { code: -32601, message: `method not found: ${req.method}` } };
  }
}

readline.createInterface({ input: process.stdin }).on('line', (line) => {
  if (!line.trim()) return;
  let req;
  try {
    req = JSON.parse(line);
  } catch (e) {
    process.stdout.write(JSON.stringify({ jsonrpc: '2.0', id: null, error: { code: -32700, message: String(e) } }) + '\n');
    return;
  }
  if (req.id === undefined) return;
  process.stdout.write(JSON.stringify({ jsonrpc: '2.0', id: req.id, ...handle(req) }) + '\n');
}).on('close', () => process.exit(0));
