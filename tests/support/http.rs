//! A real axum server on an ephemeral loopback port and a real HTTP client.
#![allow(dead_code)]

use std::net::SocketAddr;

use axum::Router;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

pub struct Server {
    pub addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Serves `app` (with `ConnectInfo<SocketAddr>`) on 127.0.0.1:0.
pub async fn serve(app: Router) -> Server {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        axum::serve(
            listener,
            app.into_make_service_with_connect_info::<SocketAddr>(),
        )
        .await
        .unwrap();
    });
    Server { addr, task }
}

pub struct Reply {
    pub status: u16,
    pub headers: http::HeaderMap,
    pub body: String,
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(|v| v.to_str().unwrap())
    }
}

pub struct HttpClient {
    client: Client<HttpConnector, Full<Bytes>>,
    base: String,
}

impl HttpClient {
    pub fn new(server: &Server) -> Self {
        Self::for_base(&format!("http://{}", server.addr))
    }

    /// A client of a server at `base` (`http://host:port`), e.g. another process.
    pub fn for_base(base: &str) -> Self {
        Self {
            client: Client::builder(TokioExecutor::new()).build_http(),
            base: base.to_owned(),
        }
    }

    pub async fn get(&self, path: &str, headers: &[(&str, &str)]) -> Reply {
        let raw: Vec<(&str, &[u8])> = headers.iter().map(|(k, v)| (*k, v.as_bytes())).collect();
        self.get_raw(path, &raw).await
    }

    /// A GET whose header values may hold any bytes a client can send (obs-text too).
    pub async fn get_raw(&self, path: &str, headers: &[(&str, &[u8])]) -> Reply {
        self.request_raw(http::Method::GET, path, headers).await
    }

    /// A request with any method.
    pub async fn request(
        &self,
        method: http::Method,
        path: &str,
        headers: &[(&str, &str)],
    ) -> Reply {
        let raw: Vec<(&str, &[u8])> = headers.iter().map(|(k, v)| (*k, v.as_bytes())).collect();
        self.request_raw(method, path, &raw).await
    }

    /// A request with a body.
    pub async fn send(
        &self,
        method: http::Method,
        path: &str,
        headers: &[(&str, &str)],
        body: &str,
    ) -> Reply {
        let raw: Vec<(&str, &[u8])> = headers.iter().map(|(k, v)| (*k, v.as_bytes())).collect();
        self.request_body(method, path, &raw, Bytes::copy_from_slice(body.as_bytes()))
            .await
    }

    async fn request_raw(
        &self,
        method: http::Method,
        path: &str,
        headers: &[(&str, &[u8])],
    ) -> Reply {
        self.request_body(method, path, headers, Bytes::new()).await
    }

    async fn request_body(
        &self,
        method: http::Method,
        path: &str,
        headers: &[(&str, &[u8])],
        body: Bytes,
    ) -> Reply {
        let mut req = http::Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.base));
        for (k, v) in headers {
            req = req.header(*k, http::HeaderValue::from_bytes(v).unwrap());
        }
        let response = self
            .client
            .request(req.body(Full::new(body)).unwrap())
            .await
            .unwrap();
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        let body = response.into_body().collect().await.unwrap().to_bytes();
        Reply {
            status,
            headers,
            body: String::from_utf8(body.to_vec()).unwrap(),
        }
    }
}
