//! An axum WebSocket whose messages pass a meter in each direction (feature `websocket`): a
//! tower layer sees the upgrade request, never a frame after it, so the handler wraps the
//! socket it is given.

use axum::extract::ws::{CloseFrame, Message, WebSocket};

use super::{StreamLimited, StreamMeter};

/// An axum [`WebSocket`] whose every text or binary message its meters admit: what the client
/// sends before [`recv`](Self::recv) returns it, what the handler sends (with an
/// [`outbound`](Self::outbound) meter) before [`send`](Self::send) writes it. A message's
/// units are its payload's bytes; pings, pongs and closes pass unmetered (the socket's own
/// housekeeping).
///
/// At a limit the meter pushes back (`recv` and `send` wait, and the socket is not read or
/// written meanwhile: the client's writes stall on TCP's flow control) or ends the socket:
/// it sends a close frame with [`StreamLimited::close_code`] (1013 at a limit, 1008 for a
/// banned key, 1009 for a message larger than a limit's burst) and
/// [`close_reason`](StreamLimited::close_reason), `recv` returns `None` and `send` an error,
/// and [`ended`](Self::ended) says why.
///
/// ```
/// use axum::extract::ws::{WebSocket, WebSocketUpgrade};
/// use tower_ratelimits::{AtLimit, Id, LimitedSocket, Limiter, StreamMeter};
///
/// /// An echo of at most the account's rate of messages; a flood is closed with 1013.
/// async fn echo(upgrade: WebSocketUpgrade, limiter: Limiter) -> axum::response::Response {
///     upgrade.on_upgrade(move |socket: WebSocket| async move {
///         let Ok(key) = limiter.key("MessagesPerAccount", Id::from(7u64)) else { return };
///         let Ok(meter) = StreamMeter::builder(&limiter).per_message(key).at_limit(AtLimit::End).build() else {
///             return;
///         };
///         let mut socket = LimitedSocket::new(socket, meter);
///         while let Some(Ok(message)) = socket.recv().await {
///             if socket.send(message).await.is_err() {
///                 break;
///             }
///         }
///     })
/// }
/// ```
#[derive(Debug)]
pub struct LimitedSocket {
    socket: WebSocket,
    inbound: StreamMeter,
    outbound: Option<StreamMeter>,
    ended: Option<StreamLimited>,
}

impl LimitedSocket {
    /// `socket`, each message the client sends admitted by `inbound`.
    pub fn new(socket: WebSocket, inbound: StreamMeter) -> Self {
        Self {
            socket,
            inbound,
            outbound: None,
            ended: None,
        }
    }

    /// Admits each message the handler sends by `meter` too.
    pub fn outbound(mut self, meter: StreamMeter) -> Self {
        self.outbound = Some(meter);
        self
    }

    /// The next message the client sent, once its meter admits it; `None` when the socket
    /// ended (the client closed it, or a limit did: [`ended`](Self::ended)).
    pub async fn recv(&mut self) -> Option<Result<Message, axum::Error>> {
        if self.ended.is_some() {
            return None;
        }
        let message = match self.socket.recv().await? {
            Ok(message) => message,
            Err(e) => return Some(Err(e)),
        };
        let Some(units) = units(&message) else {
            return Some(Ok(message));
        };
        match self.inbound.admit(units).await {
            Ok(()) => Some(Ok(message)),
            Err(why) => {
                self.close(why).await;
                None
            }
        }
    }

    /// Sends `message`, once the outbound meter (if any) admits it; at a limit that ends the
    /// socket, closes it and fails.
    pub async fn send(&mut self, message: Message) -> Result<(), axum::Error> {
        if let Some(why) = &self.ended {
            return Err(axum::Error::new(why.to_string()));
        }
        if let (Some(meter), Some(units)) = (&mut self.outbound, units(&message))
            && let Err(why) = meter.admit(units).await
        {
            let error = axum::Error::new(why.to_string());
            self.close(why).await;
            return Err(error);
        }
        self.socket.send(message).await
    }

    /// Why a limit ended the socket (`None`: it did not).
    pub fn ended(&self) -> Option<&StreamLimited> {
        self.ended.as_ref()
    }

    /// The meter of the client's messages: what it was admitted so far.
    pub fn inbound(&self) -> &StreamMeter {
        &self.inbound
    }

    /// The socket, unmetered from here on.
    pub fn into_inner(self) -> WebSocket {
        self.socket
    }

    /// Closes the socket with the reason's code and sentence (a socket already gone is not
    /// an error: the reason stays).
    async fn close(&mut self, why: StreamLimited) {
        let frame = CloseFrame {
            code: why.close_code(),
            reason: why.close_reason().into(),
        };
        let _ = self.socket.send(Message::Close(Some(frame))).await;
        self.ended = Some(why);
    }
}

/// A message's units: its payload's bytes; `None` for the socket's housekeeping, which is not
/// metered.
fn units(message: &Message) -> Option<u64> {
    match message {
        Message::Text(text) => Some(text.len() as u64),
        Message::Binary(data) => Some(data.len() as u64),
        Message::Ping(_) | Message::Pong(_) | Message::Close(_) => None,
    }
}
