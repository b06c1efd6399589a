//! The bridge between participants and the engine: the gateway in front of the pipeline and the
//! listeners participants connect to.
//!
//! - [`frame`]: the framed-XML wire format over TCP;
//! - [`gateway`]: submission, ACK/NAK routing after commit, pushes of CLS and advices;
//! - [`listener`]: the accept loop the listeners share;
//! - [`tcp`]: the framed-XML listener;
//! - [`soap`]: SOAP 1.1/1.2 over HTTP/1.1, with its WSDL and MTOM;
//! - [`fix`]: FIX 4.4 sessions and the mapping of STE messages to FIX;
//! - [`client`]: a blocking framed-XML client (the driver's `--target tcp://`).

pub mod bench;
pub mod client;
pub mod fix;
pub mod frame;
pub mod gateway;
pub mod listener;
pub mod soap;
pub mod tcp;
pub mod tls;
