//! `bare-hyper LISTEN=UPSTREAM...`: a plain HTTP/1 reverse proxy on hyper's server and
//! hyper-util's pooled client, on tokio's default runtime — the stack fleetgate is built
//! on, with none of its work (no key, no limits, no parsing, no metering, no log). Each
//! request goes to its listener's upstream as it came; the answer's status, headers and
//! body come back as they arrive. `benches/side-by-side/run` runs it beside nginx and
//! fleetgate, so that what the stack itself costs shows in the same run.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::process::ExitCode;

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Empty};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode, Uri};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;

type Body = BoxBody<Bytes, hyper::Error>;
type Upstream = Client<HttpConnector, Incoming>;

const USAGE: &str = "usage: bare-hyper LISTEN=UPSTREAM... (e.g. 127.0.0.1:8001=127.0.0.1:8000)";

#[tokio::main]
async fn main() -> ExitCode {
    let Some(pairs) = pairs(std::env::args().skip(1)) else {
        eprintln!("{USAGE}");
        return ExitCode::from(2);
    };
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: Upstream = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(1024)
        .build(connector);
    let mut listeners = tokio::task::JoinSet::new();
    for (listen, upstream) in pairs {
        let listener = match TcpListener::bind(listen).await {
            Ok(listener) => listener,
            Err(err) => {
                eprintln!("bare-hyper: cannot listen on {listen}: {err}");
                return ExitCode::FAILURE;
            }
        };
        listeners.spawn(serve(listener, upstream, client.clone()));
    }
    while listeners.join_next().await.is_some() {}
    ExitCode::SUCCESS
}

/// The `LISTEN=UPSTREAM` arguments, at least one; `None` if any is not two addresses.
fn pairs(args: impl Iterator<Item = String>) -> Option<Vec<(SocketAddr, SocketAddr)>> {
    let pairs = args
        .map(|arg| {
            let (listen, upstream) = arg.split_once('=')?;
            Some((listen.parse().ok()?, upstream.parse().ok()?))
        })
        .collect::<Option<Vec<_>>>()?;
    (!pairs.is_empty()).then_some(pairs)
}

async fn serve(listener: TcpListener, upstream: SocketAddr, client: Upstream) {
    loop {
        let Ok((tcp, _)) = listener.accept().await else {
            // Out of file descriptors, say: wait a little rather than spin.
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            continue;
        };
        let _ = tcp.set_nodelay(true);
        let client = client.clone();
        tokio::spawn(async move {
            let service = service_fn(move |request| forward(request, upstream, client.clone()));
            let _ = http1::Builder::new()
                .serve_connection(TokioIo::new(tcp), service)
                .await;
        });
    }
}

async fn forward(
    mut request: Request<Incoming>,
    upstream: SocketAddr,
    client: Upstream,
) -> Result<Response<Body>, Infallible> {
    let path = request.uri().path_and_query().map_or("/", |p| p.as_str());
    let Ok(uri) = format!("http://{upstream}{path}").parse::<Uri>() else {
        return Ok(status(StatusCode::BAD_REQUEST));
    };
    *request.uri_mut() = uri;
    Ok(match client.request(request).await {
        Ok(answer) => answer.map(|body| body.boxed()),
        Err(_) => status(StatusCode::BAD_GATEWAY),
    })
}

fn status(code: StatusCode) -> Response<Body> {
    let mut response = Response::new(Empty::new().map_err(|never| match never {}).boxed());
    *response.status_mut() = code;
    response
}
