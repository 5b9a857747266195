//! What the host services add to every invoke, against the operations they are built from, in the same run.
//!
//! A real nats-server with JetStream; `FleetServices` opened as `fleet up` opens it; one user with a grant of
//! every service capability to one plugin. Measured:
//! - A `kv_read` — one JetStream KV `entry` read of that user's grant record (the physical floor of the grant
//!   check: the grant lives in KV and must be read per invoke, so revocations apply at once);
//! - B `mint` — `TokenSource::tokens` for an invoke that negotiated and declared storage and upload: the grant
//!   read, two HS256 JWTs signed, the invoke's budget created (then dropped with `invoke_finished`, untimed
//!   bookkeeping included in B since every invoke pays it);
//! - C `mint_nothing` — `tokens` for a plugin that declares no capability (no read, no token: the common case);
//! - D `verify` — verifying one storage token against its invoke, as every reverse call does, against
//!   E `sha256` of the same token bytes (the floor of one HMAC-SHA256 pass over them).
//!
//! - F `api_verify` — the front's check of an app's API JWT (HS256) the first time it sees it (signature and
//!   claims: `Verifier::verify_with_claims`), against G `api_verify_cached` — the same token again through
//!   `Verifier::verify`, answered from the verified-token cache (SHA-256 of the token, expiry check).
//!
//! - H `credentials` — `TokenSource::credentials` for an invoke of a plugin that declares three credential names,
//!   two of them stored (one user-wide, one for the plugin): one KV read of the user's sealed record, the data
//!   key unwrapped, two values opened (AES-256-GCM), against A (the same kind of read).
//!
//! Criterion measures each; then an interleaved pass (A to H in turn, 2 000 rounds) prints medians and
//! the ratios B/A, D/E, G/F and H/A, so a noisy machine's slow phases hit every measure alike.
#![allow(clippy::unwrap_used, clippy::print_stdout, clippy::cast_precision_loss)]

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use fleet::nats_server::NatsServer;
use fleet_proto::api::user_key;
use fleet_proto::util::now_ms;
use fleet_services::args::ServicesArgs;
use fleet_services::tokens::AUD_STORAGE;
use fleet_services::{Binding, FleetServices};
use fleet_store::StoreSettings;
use fleet_worker::services::{HostServices as _, TokenRequest, TokenSource};
use sha2::Digest as _;

const USER: &str = "bench-user";
const TOOL: &str = "tool-bench";

struct Env {
    _nats: NatsServer,
    _dir: tempfile::TempDir,
    rt: tokio::runtime::Runtime,
    services: FleetServices,
    grants_kv: async_nats::jetstream::kv::Store,
}

fn request(invoke: &str, with_caps: bool) -> TokenRequest {
    let (negotiated, declared): (BTreeSet<String>, Vec<String>) = if with_caps {
        (
            ["storage", "upload"].into_iter().map(str::to_owned).collect(),
            ["aps.kv", "aps.files", "host.upload"]
                .into_iter()
                .map(str::to_owned)
                .collect(),
        )
    } else {
        (BTreeSet::new(), Vec::new())
    };
    TokenRequest {
        user: USER.into(),
        tool_id: TOOL.into(),
        invoke_id: invoke.into(),
        negotiated,
        declared,
        credentials: Vec::new(),
        deadline_ms: now_ms() + 60_000,
    }
}

fn setup() -> Env {
    let dir = tempfile::tempdir().unwrap();
    let nats = NatsServer::start(&dir.path().join("nats")).unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let (services, grants_kv) = rt.block_on(async {
        let client = nats.connect(fleet_client::creds::Role::Front).await.unwrap();
        let js = async_nats::jetstream::new(client);
        let services = ServicesArgs::default()
            .open(&js, &StoreSettings::default(), dir.path(), None)
            .await
            .unwrap();
        let all = ["aps.kv", "aps.files", "host.upload"].map(str::to_owned);
        services.grants().edit(USER, TOOL, &all, &[]).await.unwrap();
        let user_wide = [("API_KEY".to_owned(), "sk-bench-user".to_owned())].into();
        let tool_only = [("REGION".to_owned(), "bench-region".to_owned())].into();
        let creds = services.credential_store();
        creds.set(USER, None, &user_wide).await.unwrap();
        creds.set(USER, Some(TOOL), &tool_only).await.unwrap();
        let kv = js.get_key_value("fleet_grants").await.unwrap();
        (services, kv)
    });
    Env {
        _nats: nats,
        _dir: dir,
        rt,
        services,
        grants_kv,
    }
}

fn grant_key() -> String {
    format!("{}.{}", user_key(USER), user_key(TOOL))
}

fn kv_read(env: &Env) {
    let e = env.rt.block_on(env.grants_kv.entry(grant_key())).unwrap();
    assert!(e.is_some());
}

fn mint(env: &Env, i: u64) {
    let id = format!("inv-{i}");
    let t = env.rt.block_on(env.services.tokens(request(&id, true)));
    assert!(t.storage.is_some() && t.upload.is_some());
    env.services.invoke_finished(&id);
}

fn mint_nothing(env: &Env, i: u64) {
    let t = env
        .rt
        .block_on(env.services.tokens(request(&format!("n-{i}"), false)));
    assert!(t.storage.is_none());
}

fn credentials(env: &Env, names: &[String]) {
    let found = env
        .rt
        .block_on(TokenSource::credentials(
            &env.services,
            USER,
            TOOL,
            names,
            u64::MAX,
        ))
        .unwrap();
    assert_eq!(found.0.len(), 2);
}

fn bench(c: &mut Criterion) {
    let names: Vec<String> = ["API_KEY", "REGION", "OPTIONAL_TOKEN"]
        .map(str::to_owned)
        .to_vec();
    let env = setup();
    let token = env
        .rt
        .block_on(env.services.tokens(request("verify", true)))
        .storage
        .unwrap();
    let binding = Binding {
        user: USER,
        tool_id: TOOL,
        invoke_id: "verify",
    };
    let verify = || {
        env.services
            .minter()
            .verify(Some(&token), AUD_STORAGE, binding)
            .unwrap();
    };
    let digest = || {
        std::hint::black_box(sha2::Sha256::digest(token.as_bytes()));
    };
    let api_secret = [7_u8; 32];
    let api = fleet_client::auth::Verifier::new(
        vec![fleet_client::auth::VerifyKey::hs256(&api_secret).unwrap()],
        "bench-issuer",
        "bench-audience",
    )
    .unwrap();
    let api_token = fleet_client::auth::SigningKey::hs256(&api_secret)
        .unwrap()
        .mint(
            USER,
            "bench-issuer",
            "bench-audience",
            Duration::from_secs(3600),
            false,
        )
        .unwrap();
    let api_verify = || {
        std::hint::black_box(api.verify_with_claims(&api_token).unwrap());
    };
    let api_cached = || {
        std::hint::black_box(api.verify(&api_token).unwrap());
    };
    let mut g = c.benchmark_group("service_tokens");
    g.measurement_time(Duration::from_secs(3));
    g.bench_function("kv_read", |b| b.iter(|| kv_read(&env)));
    let mut i = 0_u64;
    g.bench_function("mint", |b| {
        b.iter(|| {
            i += 1;
            mint(&env, i);
        });
    });
    g.bench_function("mint_nothing", |b| {
        b.iter(|| {
            i += 1;
            mint_nothing(&env, i);
        });
    });
    g.bench_function("verify", |b| b.iter(verify));
    g.bench_function("sha256", |b| b.iter(digest));
    g.bench_function("api_verify", |b| b.iter(api_verify));
    g.bench_function("api_verify_cached", |b| b.iter(api_cached));
    g.bench_function("credentials", |b| b.iter(|| credentials(&env, &names)));
    g.finish();

    // Interleaved pass.
    let mut samples: [Vec<f64>; 8] = Default::default();
    for round in 0..2_000_u64 {
        let time = |f: &mut dyn FnMut()| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64() * 1e6
        };
        samples[0].push(time(&mut || kv_read(&env)));
        samples[1].push(time(&mut || mint(&env, 1_000_000 + round)));
        samples[2].push(time(&mut || mint_nothing(&env, 1_000_000 + round)));
        samples[3].push(time(&mut || verify()));
        samples[4].push(time(&mut || digest()));
        samples[5].push(time(&mut || api_verify()));
        samples[6].push(time(&mut || api_cached()));
        samples[7].push(time(&mut || credentials(&env, &names)));
    }
    let med: Vec<f64> = samples
        .iter_mut()
        .map(|s| {
            s.sort_by(f64::total_cmp);
            s[s.len() / 2]
        })
        .collect();
    println!(
        "service_tokens interleaved medians (µs): kv_read {:.1}, mint {:.1}, mint_nothing {:.2}, verify {:.2}, sha256 {:.3}, api_verify {:.2}, api_verify_cached {:.2}, credentials {:.1}",
        med[0], med[1], med[2], med[3], med[4], med[5], med[6], med[7]
    );
    println!(
        "service_tokens ratios: mint / kv_read = {:.2}x, verify / sha256 = {:.1}x, api_verify_cached / api_verify = {:.3}x, credentials / kv_read = {:.2}x",
        med[1] / med[0],
        med[3] / med[4],
        med[6] / med[5],
        med[7] / med[0]
    );
}

criterion_group!(benches, bench);
criterion_main!(benches);
