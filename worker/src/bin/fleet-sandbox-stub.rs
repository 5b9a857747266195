//! The sandbox stub program for workers embedded as a library (tests, benches): `fleet` is its own stub
//! program (`fleet_worker::sandbox::run_if_stub` is the first thing its `main` does). See
//! `worker/src/sandbox/stub.rs`.

use std::process::ExitCode;

fn main() -> ExitCode {
    fleet_worker::sandbox::run_if_stub();
    // Not started by a worker as a stub.
    let _ = std::io::Write::write_all(
        &mut std::io::stderr(),
        b"fleet-sandbox-stub: started by a worker only (see worker/src/sandbox/stub.rs)\n",
    );
    ExitCode::from(2)
}
