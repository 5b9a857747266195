//! Logs and traces: one `tracing` subscriber with the JSON log layer and, when an OTLP endpoint is configured
//! (`--otlp-endpoint` / `FLEET_OTLP_ENDPOINT`; off by default), a `tracing-opentelemetry` layer exporting spans
//! over OTLP/gRPC (tonic) with a batch processor.
//!
//! W3C trace context (`traceparent`, `tracestate`) travels in NATS message headers between the front and the
//! workers ([`inject`], [`extract`]) and reaches the plugin as `context.traceparent` of the invoke.
//!
//! Span attributes never hold tokens, credentials or user ids: a user appears only as [`user_hash`].
//!
//! Spans are for traces, events for logs: the log layer sees events only (formatting every span's fields into
//! JSON at its creation, for the few requests that log anything, cost 6 % of a `tools.invoke` in
//! `benches/fleet_roundtrip.rs`), and a line logged inside a traced span carries its `trace_id`, which finds the
//! request's spans in the tracing backend. A log event names what it is about in its own fields.

use opentelemetry::propagation::{Extractor, Injector};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig as _;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;
use tracing_subscriber::Layer as _;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;

/// Flushes and shuts the tracer provider down when dropped (keep it alive for the process's life).
#[derive(Debug)]
pub struct TelemetryGuard {
    provider: SdkTracerProvider,
}

impl TelemetryGuard {
    /// Exports every finished span now.
    pub fn force_flush(&self) -> Result<(), String> {
        self.provider.force_flush().map_err(|e| e.to_string())
    }
}

impl Drop for TelemetryGuard {
    fn drop(&mut self) {
        let _ = self.provider.force_flush();
        let _ = self.provider.shutdown();
    }
}

/// Why telemetry could not start.
#[derive(Debug, thiserror::Error)]
#[error("OTLP exporter: {0}")]
pub struct TelemetryError(String);

/// The process's subscriber layers, boxed: what [`init`] installs (and what a bench installs under a switch of
/// its own, to measure their cost).
pub type Layers = Box<dyn tracing_subscriber::Layer<tracing_subscriber::Registry> + Send + Sync>;

/// Builds the production layers: JSON logs on stderr filtered by `FLEET_LOG` (else `default_filter`), plus the
/// OpenTelemetry layer exporting to `endpoint` (e.g. `http://127.0.0.1:4317`) when given, with the tracer
/// provider that must outlive them (flushed and shut down by its guard).
pub fn layers(
    endpoint: Option<&str>,
    service_name: &str,
    default_filter: &str,
) -> Result<(Layers, Option<SdkTracerProvider>), TelemetryError> {
    layers_to(endpoint, service_name, default_filter, std::io::stderr)
}

/// [`layers`] with the log lines written to `writer` (tests read them).
pub fn layers_to<W>(
    endpoint: Option<&str>,
    service_name: &str,
    default_filter: &str,
    writer: W,
) -> Result<(Layers, Option<SdkTracerProvider>), TelemetryError>
where
    W: for<'w> tracing_subscriber::fmt::MakeWriter<'w> + Send + Sync + 'static,
{
    let filter = || {
        tracing_subscriber::EnvFilter::try_from_env("FLEET_LOG").unwrap_or_else(|_| {
            // The OpenTelemetry SDK's own info lines (provider set, exporter built) are noise in service logs.
            tracing_subscriber::EnvFilter::new(format!(
                "{default_filter},opentelemetry=warn,opentelemetry_sdk=warn,opentelemetry_otlp=warn"
            ))
        })
    };
    let fmt = tracing_subscriber::fmt::layer()
        .json()
        .event_format(WithTraceId(tracing_subscriber::fmt::format().json()))
        .with_writer(writer)
        .with_filter(tracing_subscriber::filter::FilterExt::and(
            filter(),
            tracing_subscriber::filter::filter_fn(|meta| meta.is_event()),
        ));
    let Some(endpoint) = endpoint.filter(|e| !e.is_empty()) else {
        return Ok((Box::new(fmt), None));
    };
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .with_endpoint(endpoint)
        .build()
        .map_err(|e| TelemetryError(e.to_string()))?;
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(
            opentelemetry_sdk::Resource::builder()
                .with_service_name(service_name.to_string())
                .build(),
        )
        .build();
    let tracer = provider.tracer("cloud-agents");
    // Only this service's spans are exported (not log events, which may name users; not dependencies' spans),
    // whatever the log filter prints. Left out of every span, for their cost on the request path (an async span
    // is entered and left at every poll): busy/idle times (two clock reads per poll), the OpenTelemetry context
    // made current at every poll (the fleet reads a span's context from the span itself, `headers`), the thread
    // and the source location (four attributes per span).
    let otel = tracing_opentelemetry::layer()
        .with_tracer(tracer)
        .with_tracked_inactivity(false)
        .with_context_activation(false)
        .with_threads(false)
        .with_location(false)
        .with_filter(tracing_subscriber::filter::filter_fn(|meta| {
            meta.is_span() && *meta.level() <= tracing::Level::INFO && meta.target().starts_with("fleet")
        }));
    Ok((Box::new(fmt.and_then(otel)), Some(provider)))
}

/// The JSON line of an event, with `"trace_id"` added when it happens inside a span that is being traced. The
/// span's context is read through the global dispatcher, where the fleet installs its subscriber ([`init`]): a
/// subscriber installed only for a scope cannot be reached again from inside its own event callback, and its
/// lines carry no trace id.
struct WithTraceId<F>(F);

impl<S, N, F> tracing_subscriber::fmt::FormatEvent<S, N> for WithTraceId<F>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    N: for<'a> tracing_subscriber::fmt::FormatFields<'a> + 'static,
    F: tracing_subscriber::fmt::FormatEvent<S, N>,
{
    fn format_event(
        &self,
        ctx: &tracing_subscriber::fmt::FmtContext<'_, S, N>,
        mut writer: tracing_subscriber::fmt::format::Writer<'_>,
        event: &tracing::Event<'_>,
    ) -> std::fmt::Result {
        use opentelemetry::trace::TraceContextExt as _;
        let cx = tracing::Span::current().context();
        let span = cx.span();
        let traced = span.span_context();
        if !traced.is_valid() {
            return self.0.format_event(ctx, writer, event);
        }
        let mut line = String::new();
        self.0.format_event(
            ctx,
            tracing_subscriber::fmt::format::Writer::new(&mut line),
            event,
        )?;
        match line.trim_end().strip_suffix('}') {
            Some(head) => writeln!(writer, "{head},\"trace_id\":\"{}\"}}", traced.trace_id()),
            None => writer.write_str(&line),
        }
    }
}

/// Installs the process's subscriber ([`layers`]) and the W3C trace-context propagator when traces are on.
/// Returns the guard of the tracer provider when traces are on. A subscriber already installed is left as it is
/// (and `None` then).
pub fn init(
    endpoint: Option<&str>,
    service_name: &str,
    default_filter: &str,
) -> Result<Option<TelemetryGuard>, TelemetryError> {
    let (layers, provider) = layers(endpoint, service_name, default_filter)?;
    let installed = tracing_subscriber::registry().with(layers).try_init().is_ok();
    let Some(provider) = provider else {
        return Ok(None);
    };
    if !installed {
        let _ = provider.shutdown();
        return Ok(None);
    }
    Ok(Some(activate(provider)))
}

/// Makes `provider` the global tracer provider and W3C trace context the propagator (what [`inject`] and
/// [`extract_into`] use); the guard flushes and shuts it down.
pub fn activate(provider: SdkTracerProvider) -> TelemetryGuard {
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    opentelemetry::global::set_tracer_provider(provider.clone());
    TelemetryGuard { provider }
}

/// Writes OpenTelemetry context into NATS headers.
struct HeaderInjector<'a>(&'a mut async_nats::HeaderMap);

impl Injector for HeaderInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        self.0.insert(key, value);
    }
}

/// Reads OpenTelemetry context from NATS headers.
struct HeaderExtractor<'a>(&'a async_nats::HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).map(|v| v.as_str())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.iter().map(|(k, _)| k.as_ref()).collect()
    }
}

/// Injects the context of `span` (W3C `traceparent` / `tracestate`) into `headers`. Without a configured
/// propagator (traces off) nothing is written.
pub fn inject(span: &tracing::Span, headers: &mut async_nats::HeaderMap) {
    let cx = span.context();
    opentelemetry::global::get_text_map_propagator(|p| p.inject_context(&cx, &mut HeaderInjector(headers)));
}

/// NATS headers carrying the context of `span`, or `None` when traces are off (nothing to propagate).
pub fn headers(span: &tracing::Span) -> Option<async_nats::HeaderMap> {
    let mut headers = async_nats::HeaderMap::new();
    inject(span, &mut headers);
    headers.get(TRACEPARENT).is_some().then_some(headers)
}

/// Makes `span` a child of the context carried by `headers` (if any).
pub fn extract_into(span: &tracing::Span, headers: Option<&async_nats::HeaderMap>) {
    let Some(headers) = headers else { return };
    if headers.get(TRACEPARENT).is_none() {
        return;
    }
    let cx = opentelemetry::global::get_text_map_propagator(|p| p.extract(&HeaderExtractor(headers)));
    let _ = span.set_parent(cx);
}

/// The W3C header (and invoke-context key) carrying the trace context.
pub const TRACEPARENT: &str = "traceparent";

/// The `traceparent` of `span`, when it belongs to a sampled OpenTelemetry trace.
pub fn traceparent(span: &tracing::Span) -> Option<String> {
    headers(span)?.get(TRACEPARENT).map(|v| v.as_str().to_string())
}

/// Records [`user_hash`] of `user` as `fleet.user_hash` on the current span; the hash is not even computed when
/// no layer takes the span (traces off).
pub fn record_user(user: &str) {
    let span = tracing::Span::current();
    if !span.is_disabled() {
        span.record("fleet.user_hash", user_hash(user));
    }
}

/// A user as span attributes may show it: the first 16 hex digits of SHA-256(user id), never the id itself.
pub fn user_hash(user: &str) -> String {
    fleet_proto::api::user_key(user).chars().take(16).collect()
}
