//! The front door: everything that speaks HTTP to clients. The connections
//! (`connections`: accepted, capped, HTTP/1 or HTTP/2, time-outs), the router and its
//! layers (`router`; the one middleware every request passes, `every_request`: request
//! id and envelope, span, request record, a panic answered), authentication and
//! body reading, the OpenAPI document's frame (`openapi`), and the route handlers
//! (`routes`). Below it, the completion core and the rest speak no HTTP to clients.

pub mod auth;
pub mod body;
pub mod connections;
mod error_response;
pub mod every_request;
pub mod fallback;
pub mod held;
pub mod openapi;
pub mod router;
pub mod routes;
